"""In-process stand-ins for the stream side, for learner tests and bench-learner.

`ListQueue` and `FifoReplay` implement the ExperienceQueue / ReplayBuffer protocols in memory
(the real ones are the Redis stream and buffer.replay, wired by the launcher);
`random_trajectories` and `build_llama` make inputs without a download.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from async_rlhf.protocols import QueueStats, ReplayDraw
from async_rlhf.types import Received, Trajectory

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


def random_trajectories(
    n: int,
    *,
    vocab: int,
    prompt_len: int = 8,
    response_len: int = 8,
    group_size: int = 4,
    version: int = 0,
    seed: int = 0,
) -> list[Trajectory]:
    """n trajectories in groups of group_size, reward = fraction of even response tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
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
    return out


class ListQueue:
    """ExperienceQueue in memory: FIFO delivery, acks counted by reason."""

    def __init__(self, trajectories: Sequence[Trajectory] = ()):
        self._next = 0
        self._entries: collections.deque[Received] = collections.deque()
        self.pending: dict[str, Received] = {}
        self.acked: dict[str, str] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self.put(trajectories)

    def put(self, trajectories: Sequence[Trajectory], timeout_s: float | None = None) -> None:
        for t in trajectories:
            self._entries.append(Received(entry_id=f"{self._next}-0", trajectory=t))
            self._next += 1
            self.counters["produced"] += 1

    def get(self, count: int, block_ms: int = 1000) -> list[Received]:
        out = [self._entries.popleft() for _ in range(min(count, len(self._entries)))]
        self.pending.update((r.entry_id, r) for r in out)
        return out

    def ack(self, entry_ids: Sequence[str], reason: str = "trained") -> None:
        for e in entry_ids:
            if self.pending.pop(e, None) is not None:
                self.acked[e] = reason
                self.counters[reason] += 1

    def renew(self, entry_ids: Sequence[str]) -> list[str]:
        """The ids still pending here (RedisExperienceQueue's ownership check)."""
        return [e for e in entry_ids if e in self.pending]

    def dead_letter(self, reason: str, detail: str, payload: bytes = b"") -> None:
        self.counters["dead_lettered"] += 1
        self.counters[reason] += 1

    def stats(self) -> QueueStats:
        return QueueStats(len(self._entries), len(self.pending), self.counters["dead_lettered"],
                          dict(self.counters))


class FifoReplay:
    """ReplayBuffer in memory: oldest first, each item used once (max_reuse = 1), stale ones
    evicted with reason "dropped_stale"."""

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self._items: collections.deque[Received] = collections.deque()

    def add(self, items: Sequence[Received]) -> None:
        self._items.extend(items)

    def draw(self, count: int, version: int) -> ReplayDraw:
        items, dropped = [], []
        while self._items and len(items) < count:
            r = self._items.popleft()
            if version - r.trajectory.policy_version > self.max_staleness:
                dropped.append((r.entry_id, "dropped_stale"))
            else:
                items.append(r)
        return ReplayDraw(items=items, first_use=[r.entry_id for r in items], dropped=dropped)

    def __len__(self) -> int:
        return len(self._items)
