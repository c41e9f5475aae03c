"""Learner inputs made in-process, without a download, for learner tests and bench-learner.

`build_llama` builds a random-init model of a preset shape; `random_groups` makes groups of
scored trajectories. `PreloadedQueue` and `OnceReplay` feed them to the learner from memory
for bench-learner, which measures learner compute alone; tests use the real Redis stream and
replay buffer instead.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from async_rlhf.protocols import QueueStats, ReplayDraw
from async_rlhf.types import Group, Received, Trajectory, TrajectoryError

# model shapes for the presets (the "small" one is ~30M parameters with a 8192 vocabulary)
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=8192),
}


def build_llama(preset: str = "tiny", seed: int = 0):
    """A random-init fp32 LlamaForCausalLM of a preset shape (transformers, offline)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**PRESETS[preset], max_position_embeddings=1024, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).float()


def random_groups(
    n: int,
    *,
    vocab: int,
    prompt_len: int = 8,
    response_len: int = 8,
    group_size: int = 4,
    version: int = 0,
    seed: int = 0,
) -> list[Group]:
    """n groups of group_size random trajectories, reward = fraction of even response tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n * group_size):
        resp = rng.integers(3, vocab, response_len).astype(np.int32)
        out.append(Trajectory(
            prompt_ids=rng.integers(3, vocab, prompt_len).astype(np.int32),
            response_ids=resp,
            behavior_logprobs=(-rng.uniform(0.5, 6.0, response_len)).astype(np.float32),
            reward=float(np.mean(resp % 2 == 0)),
            reward_parts={"even": float(np.mean(resp % 2 == 0))},
            policy_version=version,
            generator_id="gen-0",
            group_id=f"s{seed}-g{i // group_size}",
            finished=True,
        ))
    return [Group(tuple(out[g:g + group_size])) for g in range(0, len(out), group_size)]


class PreloadedQueue:
    """ExperienceQueue over pre-generated groups in memory, for bench-learner only: a
    benchmark of learner compute, not a test (tests use the real Redis stream). The learner is
    its one consumer, so every entry it gets stays its own (renew keeps all); acks just count."""

    def __init__(self) -> None:
        self._entries: collections.deque[Received] = collections.deque()
        self._next = 0
        self.acked: collections.Counter[str] = collections.Counter()  # reason -> groups

    def put(self, groups: Sequence[Group], timeout_s: float | None = None) -> None:
        for g in groups:
            self._entries.append(Received(f"{self._next}-0", g))
            self._next += 1

    def get(self, count: int, block_ms: int = 1000) -> list[Received]:
        return [self._entries.popleft() for _ in range(min(count, len(self._entries)))]

    def ack(self, entry_ids: Sequence[str], reason: str = "trained") -> None:
        self.acked[reason] += len(entry_ids)

    def renew(self, entry_ids: Sequence[str]) -> list[str]:
        return list(entry_ids)

    def reject(self, rejected: Sequence[tuple[Received, TrajectoryError]]) -> None:
        raise RuntimeError(f"bench-learner data was rejected: {rejected[0][1]}")

    def dead_letter(self, reason: str, detail: str, payload: bytes = b"") -> None:
        raise RuntimeError(f"bench-learner data was set aside ({reason}: {detail})")

    def stats(self) -> QueueStats:
        return QueueStats(len(self._entries), 0, 0, dict(self.acked))


class OnceReplay:
    """ReplayBuffer for bench-learner only: each group handed out once, in arrival order, with no
    staleness logic (the bench stamps every group with the version that trains it; tests
    use buffer.replay.StalenessReplay)."""

    def __init__(self) -> None:
        self._items: collections.deque[Received] = collections.deque()

    def add(self, items: Sequence[Received]) -> None:
        self._items.extend(items)

    def draw(self, count: int, version: int) -> ReplayDraw:
        items = [self._items.popleft() for _ in range(min(count, len(self._items)))]
        return ReplayDraw(items=items, first_use=[r.entry_id for r in items], dropped=[])

    def __len__(self) -> int:
        return len(self._items)
