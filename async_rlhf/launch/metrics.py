"""What a job measured, written where users read it: a row per learner step to OUT/metrics.jsonl,
its numbers to TensorBoard at the step's version, and a console line; held-out evaluations to
TensorBoard at the version they evaluated, and a console line each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, out: Path, steps: int):
        from torch.utils.tensorboard import SummaryWriter

        self.steps = steps  # the job's learner.steps, for the console line
        self.tb = SummaryWriter(str(out / "tensorboard"))
        self.jsonl = (out / "metrics.jsonl").open("a")  # a resumed job appends

    def step(self, row: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(row, default=float) + "\n")
        self.jsonl.flush()
        for key, value in row.items():
            if isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, row["policy_version"])
        print(f"step {row['step']:>4}/{self.steps}  reward {row['reward_mean']:.3f}  "
              f"loss {row.get('loss', float('nan')):+.4f}  staleness max {row['staleness_max']} "
              f"mean {row['staleness_mean']:.2f}  {row['samples_per_s']:.1f} samples/s  "
              f"sync {row.get('weight_sync_s', 0.0) * 1000:.0f} ms  gens {row['generators']}  "
              f"t {row['time']:.0f}s", flush=True)

    def evaluation(self, e: dict[str, Any]) -> None:
        for key, value in e.items():
            if key.startswith("eval_"):
                self.tb.add_scalar(key, value, e["policy_version"])
        extra = "".join(f"  {k[5:]} {v:.3f}" for k, v in e.items()
                        if k.startswith(("eval_pass@", "eval_reward_s")))
        print(f"eval v{e['policy_version']:>4}  reward {e['eval_reward']:.3f} (greedy, "
              f"{e['eval_prompts']} held-out prompts){extra}  {e['eval_s']:.1f} s", flush=True)

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()
