"""Learner-side replay with a staleness bound (implements ReplayBuffer). Pure logic, no I/O.

It holds whole groups (one stream entry each, `Received.group`), and draws, counts and evicts
groups, never single samples. Each group may be trained on up to `max_reuse` times while its
staleness at the learner, `version - group.policy_version` (its oldest member's), is at most
`max_staleness`. `draw` first evicts what the bound no longer allows, then hands out the
least-used groups, oldest first (policy_version ascending, then arrival): the order the
staleness gate assumes (async_rlhf/staleness.py: samples are trained in the order they are
accepted), and the one that trains a group before it goes stale rather than letting newer
groups push it past the bound. The ReplayDraw it returns tells the learner what to
acknowledge on the queue:
  - first_use: ids trained for the first time in this draw: ack them as "trained" after the step
    (the queue entry is then gone; later reuses come from memory only);
  - dropped: (id, "dropped_stale") for items evicted before they were ever trained: ack now.
Items evicted after at least one use were acked already; they are only counted in `evicted`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from async_rlhf.protocols import ReplayDraw
from async_rlhf.types import Received


@dataclass
class _Slot:
    item: Received
    uses: int
    seq: int  # arrival order, the last tie-break
    drawn_at: int = -1  # learner version of its last draw: at most once per version (one step)


@dataclass
class StalenessReplay:
    max_reuse: int = 1
    max_staleness: int = 0
    evicted: Counter = field(default_factory=Counter)  # reason -> count, for logs and tests
    _slots: dict[str, _Slot] = field(default_factory=dict, init=False, repr=False)
    _seq: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_reuse < 1:
            raise ValueError(f"max_reuse must be >= 1, got {self.max_reuse}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def add(self, items: Sequence[Received]) -> None:
        """Keep new groups; an id already held (a redelivery) is ignored and counted."""
        for item in items:
            if item.entry_id in self._slots:
                self.evicted["duplicate_ignored"] += 1
                continue
            self._slots[item.entry_id] = _Slot(item, 0, self._seq)
            self._seq += 1

    def draw(self, count: int, version: int) -> ReplayDraw:
        """Up to `count` groups usable at learner `version`, none already drawn at this version
        (a step may draw several times while it fills its batch): least-used first, then oldest
        (lowest policy_version), then first come."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        dropped: list[tuple[str, str]] = []
        for entry_id, slot in list(self._slots.items()):
            if version - slot.item.group.policy_version > self.max_staleness:
                del self._slots[entry_id]
                if slot.uses == 0:
                    dropped.append((entry_id, "dropped_stale"))
                    self.evicted["dropped_stale"] += 1
                else:
                    self.evicted["stale_after_use"] += 1
        order = sorted(
            (s for s in self._slots.values() if s.drawn_at != version),
            key=lambda s: (s.uses, s.item.group.policy_version, s.seq),
        )
        chosen = order[:count]
        first_use = [s.item.entry_id for s in chosen if s.uses == 0]
        for slot in chosen:
            slot.uses += 1
            slot.drawn_at = version
            if slot.uses >= self.max_reuse:
                del self._slots[slot.item.entry_id]
                self.evicted["reuse_spent"] += 1
        return ReplayDraw(items=[s.item for s in chosen], first_use=first_use, dropped=dropped)

    def __len__(self) -> int:
        return len(self._slots)
