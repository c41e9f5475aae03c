"""One global learner batch as tensors: whole groups flattened to rows, identical on every rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from async_rlhf.types import Received

_INT_KEYS = ("input_ids", "attention_mask", "positions", "versions", "groups")
_FLOAT_KEYS = ("mask", "behavior_logp", "rewards", "finished")


@dataclass
class Batch:
    """One global batch as tensors, identical on every rank. B rows, L = longest prompt +
    response, T = longest response."""

    input_ids: torch.Tensor  # int64 [B, L], right-padded with 0
    attention_mask: torch.Tensor  # int64 [B, L]
    positions: torch.Tensor  # int64 [B, T], index of the logit predicting response token t
    versions: torch.Tensor  # int64 [B], policy_version that generated each row
    groups: torch.Tensor  # int64 [B], group index (same prompt -> same index)
    mask: torch.Tensor  # float32 [B, T], 1 on the response tokens the model sampled
    behavior_logp: torch.Tensor  # float32 [B, T]
    rewards: torch.Tensor  # float32 [B]
    finished: torch.Tensor  # float32 [B], 0 where the response was cut at its token limit

    @classmethod
    def from_received(cls, items: Sequence[Received]) -> Batch:
        """The received groups' members as rows, group after group; `groups` = item index."""
        trajs = [t for r in items for t in r.group.members]
        B = len(trajs)
        L = max(t.num_tokens for t in trajs)
        T = max(len(t.response_ids) for t in trajs)
        out = cls(
            input_ids=torch.zeros(B, L, dtype=torch.long),
            attention_mask=torch.zeros(B, L, dtype=torch.long),
            positions=torch.zeros(B, T, dtype=torch.long),
            versions=torch.tensor([t.policy_version for t in trajs], dtype=torch.long),
            groups=torch.tensor([g for g, r in enumerate(items) for _ in r.group.members], dtype=torch.long),
            mask=torch.zeros(B, T),
            behavior_logp=torch.zeros(B, T),
            rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
            finished=torch.tensor([t.finished for t in trajs], dtype=torch.float32),
        )
        for i, t in enumerate(trajs):
            P, R = len(t.prompt_ids), len(t.response_ids)  # P >= 1: checked by Learner._admit
            ids = np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64)
            out.input_ids[i, : P + R] = torch.from_numpy(ids)
            out.attention_mask[i, : P + R] = 1
            out.positions[i] = (P - 1 + torch.arange(T)).clamp(max=L - 2)
            out.mask[i, :R] = torch.from_numpy(t.loss_mask()) if t.observation_spans else 1.0
            out.behavior_logp[i, :R] = torch.from_numpy(t.behavior_logprobs.astype("float32"))
        return out

    def rows(self, index: torch.Tensor) -> Batch:
        return Batch(**{k: getattr(self, k)[index] for k in _INT_KEYS + _FLOAT_KEYS})

    def trimmed(self) -> Batch:
        """These rows without the columns that are padding in all of them: L cut to the longest
        row, T to the longest response (a padding slot's position clamped into the cut). A
        micro-batch's forward then computes nothing on padding it does not need."""
        # T: up to the last sampled token of any row (an episode's mask has holes, observations)
        sampled = self.mask.any(0).nonzero()
        L, T = int(self.attention_mask.sum(1).max()), int(sampled[-1]) + 1 if len(sampled) else 1
        return dataclasses.replace(
            self, input_ids=self.input_ids[:, :L], attention_mask=self.attention_mask[:, :L],
            positions=self.positions[:, :T].clamp(max=L - 2), mask=self.mask[:, :T],
            behavior_logp=self.behavior_logp[:, :T])

    def to(self, device: str) -> Batch:
        return Batch(**{k: getattr(self, k).to(device) for k in _INT_KEYS + _FLOAT_KEYS})

    @staticmethod
    def broadcast(batch: Batch | None, device: str) -> Batch:
        """Rank 0's batch on every rank (call on all ranks; others pass None)."""
        shape = torch.zeros(3, dtype=torch.long, device=device)
        if dist.get_rank() == 0:
            shape[:] = torch.tensor([*batch.input_ids.shape, batch.mask.shape[1]])
        dist.broadcast(shape, 0)
        B, L, T = shape.tolist()
        dims = {"input_ids": (B, L), "attention_mask": (B, L), "positions": (B, T), "versions": (B,),
                "groups": (B,), "mask": (B, T), "behavior_logp": (B, T), "rewards": (B,), "finished": (B,)}
        out = {}
        for k, dim in dims.items():
            dtype = torch.long if k in _INT_KEYS else torch.float32
            t = getattr(batch, k).to(device) if dist.get_rank() == 0 else torch.empty(dim, dtype=dtype, device=device)
            dist.broadcast(t, 0)
            out[k] = t
        return Batch(**out)

    def reward_by_version(self) -> dict[int, tuple[int, float]]:
        """{generating policy version: (samples, mean reward)}: the reward each policy earned,
        which a staleness-lagged batch mean blurs across versions."""
        out = {}
        for v in self.versions.unique().tolist():
            rewards = self.rewards[self.versions == v]
            out[v] = (len(rewards), float(rewards.mean()))
        return out


def pack_rows(lengths: Sequence[int], cap: int | None) -> list[list[int]]:
    """Rows (longest first, as the learner orders a micro-batch's) in bins of at most `cap`
    tokens (None: one bin; a row longer than cap gets a bin of its own), first fit."""
    cap = max(max(lengths), cap or sum(lengths))
    bins: list[list[int]] = []
    fill: list[int] = []
    for row, n in enumerate(lengths):
        b = next((b for b, f in enumerate(fill) if f + n <= cap), len(bins))
        if b == len(bins):
            bins.append([])
            fill.append(0)
        bins[b].append(row)
        fill[b] += n
    return bins


def packed(input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
           bins: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [B, L] (right-padded) packed end to end into `bins` (pack_rows) [R, C]: their tokens,
    position ids that restart at each row, which the model's attention reads as separate
    sequences (transformers' packed-sequence masks; flash-attention's varlen kernels), and
    `positions` [B, T] as indices into the bins laid end to end ([R * C]). A bin's tail of
    padding is a sequence of its own that no token attends to; a position past its row's last
    token (a padding slot's) is clamped into the row."""
    lengths = attention_mask.sum(1)
    width = max(int(lengths[list(rows)].sum()) for rows in bins)
    ids = input_ids.new_zeros(len(bins), width)
    position_ids = torch.arange(width, device=ids.device).repeat(len(bins), 1)
    start = torch.zeros_like(lengths)
    for b, rows in enumerate(bins):
        at = 0
        for row in rows:
            n = int(lengths[row])
            ids[b, at:at + n] = input_ids[row, :n]
            position_ids[b, at:at + n] = torch.arange(n)
            start[row] = b * width + at
            at += n
        position_ids[b, at:] = torch.arange(width - at)
    last = (lengths - 2).clamp(min=0)[:, None]
    return ids, position_ids, torch.minimum(positions, last) + start[:, None]


def token_staleness(items: Sequence[Received], version: int) -> float:
    """Mean of version - (the version that sampled it) over the items' response tokens (NaN on
    ranks that hold no items): with in-flight updates, lower than the per-sample staleness."""
    tokens = [t.token_versions() for r in items for t in r.group.members]
    return float(version - np.concatenate(tokens).mean()) if tokens else float("nan")
