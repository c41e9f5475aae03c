"""The learner: importance-ratio-corrected PPO on DeepSpeed.

losses.py        decoupled PPO / KL / entropy / value losses, aggregation (pure torch)
advantages.py    GRPO, RLOO, REINFORCE++, GAE (pure torch)
deepspeed_backend.py  the DeepSpeed engines (policy, reference, critic), weight gather, checkpoints
learner.py       the loop: stream -> replay -> step -> ack -> version -> publish
bench.py         `async-rlhf bench-learner`; bench_feed.py its in-memory queue and replay

Imports only async_rlhf.*; DeepSpeed and transformers are imported inside the backend.
"""
