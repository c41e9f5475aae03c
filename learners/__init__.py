"""The learner: importance-ratio-corrected PPO, or DPO / rejection sampling, on a train backend
(DeepSpeed, or plain torch).

losses.py        decoupled PPO / KL / entropy / value / DPO losses, aggregation (pure torch)
advantages.py    GRPO, RLOO, REINFORCE++, GAE (pure torch)
models.py        the policy, reference and critic every backend loads, and their log-probs and values
deepspeed_backend.py  the DeepSpeed engines (policy, reference, critic), weight gather, checkpoints
torch_backend.py the same on torch.optim.AdamW in one process (world size 1)
learner.py       the loop: stream -> replay -> step -> ack -> version -> publish
checkpoints.py   the `latest` file: which checkpoint a run resumes from (no torch: the launcher reads it)
preference.py    learner.algorithm dpo and rs: the rows each batch trains and their loss

Imports only async_rlhf.*; DeepSpeed and transformers are imported inside the backends.
"""
