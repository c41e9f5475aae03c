"""The benchmarks, on one harness (harness.py: a measurement in a child process, warm-up then
time, verdicts declared as targets, JSON + Markdown + PNG).

jobs.py     `async-rlhf bench`: asynchronous vs synchronous training, whole jobs side by side
stages.py   its stage bounds: generation, the engine and training, each alone
report.py   its report: each job's timed window, the verdicts, bench.md and bench.png
gen.py      `async-rlhf bench-gen`: generation throughput, vLLM vs transformers
learner.py  `async-rlhf bench-learner`: learner throughput and where its time goes (fed from memory)
stream.py   `async-rlhf bench-queue`: the experience stream vs raw redis-py
"""
