"""bench-learner's data feed: groups held in memory, handed to the learner through the
ExperienceQueue and ReplayBuffer protocols without Redis, so the bench measures learner compute
alone (`bench-queue` measures the stream). Tests use the real Redis stream and replay buffer.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from async_rlhf.protocols import QueueStats, ReplayDraw
from async_rlhf.types import Group, Received, TrajectoryError


class PreloadedQueue:
    """ExperienceQueue over groups put in memory. The learner is its one consumer, so every
    entry it gets stays its own (renew keeps all); acks just count."""

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
    """ReplayBuffer that hands out each group once, in arrival order, with no staleness logic
    (the bench stamps every group with the version that trains it)."""

    def __init__(self) -> None:
        self._items: collections.deque[Received] = collections.deque()

    def add(self, items: Sequence[Received]) -> None:
        self._items.extend(items)

    def draw(self, count: int, version: int) -> ReplayDraw:
        items = [self._items.popleft() for _ in range(min(count, len(self._items)))]
        return ReplayDraw(items=items, first_use=[r.entry_id for r in items], dropped=[])

    def __len__(self) -> int:
        return len(self._items)
