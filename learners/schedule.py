"""The policy's learning rate over a run, step by step (learner.lr_warmup_steps, lr_schedule).

A pure function of the learner step, which is the policy version before the step: a resumed
learner takes up the schedule where its checkpoint left it with no scheduler state of its own.
The decay follows transformers' get_{linear,cosine}_schedule_with_warmup (TRL's and OpenRLHF's),
its warmup one step earlier: their first step trains at lr 0, here the first of W warmup steps
trains at lr / W and the W-th at lr.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def lr_at(step: int, *, lr: float, warmup: int, total: int, schedule: Schedule) -> float:
    """The learning rate of learner step `step` (0-based) of a run of `total` steps.

    step < warmup:  lr * (step + 1) / warmup
    after it, with p = (step - warmup) / (total - warmup), capped at 1:
        constant  lr;  linear  lr * (1 - p);  cosine  lr * (1 + cos(pi p)) / 2
    so the decay reaches 0 at step `total`, past the run's last step (p < 1 there).
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    p = min((step - warmup) / max(total - warmup, 1), 1.0)
    if schedule == "linear":
        return lr * (1.0 - p)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"learning-rate schedule {schedule!r} unknown: use constant, linear or cosine")
