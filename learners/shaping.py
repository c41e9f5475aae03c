"""What the learner does to a batch's rewards and mask before advantages: overlong handling
(DAPO) and reward normalisation and clipping (OpenRLHF, AReaL), in this order:

    1. learner.overlong: mask  - a response cut at its token limit (not `finished`: a completion
                                 at generator.max_new_tokens, an episode at env.max_tokens or
                                 env.max_turns) gets loss mask 0: its reward says nothing sure
                                 about it (DAPO's overlong filtering). It still counts in its
                                 group's baseline.
                         soft  - DAPO's soft overlong punishment: the reward falls linearly by
                                 up to overlong_penalty over the last overlong_buffer tokens
                                 before the limit.
    2. learner.reward_norm      - (reward - running mean) / running std, over every reward the
                                  learner has trained on (this batch's included).
    3. learner.reward_clip c    - the reward clipped to [-c, c].

The metrics' rewards stay the rewards as scored; only advantages see these. Every rank computes
the same from the same (broadcast) batch, so the running statistics agree across ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from async_rlhf.config import LearnerConfig

from learners.batch import Batch


def soft_overlong_penalty(lengths: torch.Tensor, limit: int, buffer: int, penalty: float) -> torch.Tensor:
    """[B] -> [B]: 0 for lengths up to limit - buffer, then falling linearly to -penalty at the
    limit, -penalty beyond (DAPO, Yu et al. 2025, eq. 13)."""
    over = (lengths.float() - (limit - buffer)).clamp(min=0) / buffer
    return -penalty * over.clamp(max=1)


class RunningMoments:
    """Mean and standard deviation of every value seen so far, updated a batch at a time
    (Chan et al.'s parallel form of Welford's algorithm, in float64)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: torch.Tensor) -> None:
        x = x.double()
        n, mean = x.numel(), float(x.mean())
        delta, total = mean - self.mean, self.count + n
        self.m2 += float(((x - mean) ** 2).sum()) + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count else 1.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), state["mean"], state["m2"]


class Shaping:
    """The learner's steps 1-3 above, from learner.* and the responses' token limit."""

    def __init__(self, cfg: LearnerConfig, response_limit: int):
        self.cfg, self.limit = cfg, response_limit
        self.moments = RunningMoments()

    @property
    def active(self) -> bool:
        return self.cfg.overlong != "none" or self.cfg.reward_norm or self.cfg.reward_clip > 0

    def __call__(self, batch: Batch) -> Batch:
        cfg, rewards, mask = self.cfg, batch.rewards, batch.mask
        if cfg.overlong == "mask":
            mask = mask * batch.finished[:, None]
        elif cfg.overlong == "soft":
            lengths = batch.attention_mask.sum(1) - batch.positions[:, 0] - 1  # prompt + response - prompt
            rewards = rewards + soft_overlong_penalty(lengths, self.limit, cfg.overlong_buffer,
                                                      cfg.overlong_penalty).to(rewards.device)
        if cfg.reward_norm:
            self.moments.update(rewards.cpu())
            rewards = (rewards - self.moments.mean) / max(self.moments.std, 1e-6)
        if cfg.reward_clip > 0:
            rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
        return dataclasses.replace(batch, rewards=rewards, mask=mask)
