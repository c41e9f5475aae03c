"""The staleness bound k as an admission gate (AReaL's rule); the learner also drops what is older.

Samples are trained in the order they are accepted (the replay serves the oldest group first),
`batch_size` per learner step, so the i-th accepted sample is trained at learner version
floor(i / batch_size). Two corrections keep that true: samples dropped before training give
their places back (`forget`), and a step that re-uses samples from replay trains fewer fresh
ones, which moves every later sample back by the shortfall (`step_trained`). A generator whose weights
are version v is admitted to generate n more samples only while

    accepted + running + n <= (k + v + 1) * batch_size,

so each of them is trained by version k + v at the latest: staleness <= k, as long as batches
finish in the order they were admitted. They need not (generators run at different speeds, and a
group whose reward failed leaves a gap), so the gate keeps staleness low rather than exact: the
learner drops (and counts) whatever still arrives older than k. A whole batch is admitted while
any slot is free, so a gap left by set-aside samples can never stall a k = 0 job one sample
short of a learner batch. Using the version of
the weights that will generate (rather than the learner's) keeps the bound exact while a weight
update is in flight, and holds back a generator that joined with old weights until it has
received new ones. k = 0 is synchronous on-policy RL: generation with version v+1 waits until the
batch for v has been trained and its weights published.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class StalenessGate:
    """Counts samples admitted for generation. Pure logic: the launcher shares one instance."""

    max_staleness: int
    batch_size: int
    accepted: int = 0  # samples generated and handed to the queue, not dropped since
    running: int = 0  # samples admitted, still being generated

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {self.batch_size}")

    def capacity(self, version: int) -> int:
        """How many more samples weights of `version` may start generating now."""
        limit = (self.max_staleness + version + 1) * self.batch_size
        return max(0, limit - (self.accepted + self.running))

    def try_admit(self, n: int, version: int) -> bool:
        """Reserve n samples of generation with weights `version` while a slot is free."""
        if self.capacity(version) <= 0:
            return False
        self.running += n
        return True

    def finish(self, n_admitted: int, n_accepted: int) -> None:
        """A generation batch ended: n_accepted of its n_admitted samples reached the queue.

        Samples set aside (a reward that failed, a generator that died) free their slots.
        """
        if not 0 <= n_accepted <= n_admitted <= self.running:
            raise ValueError(
                f"finish({n_admitted}, {n_accepted}) with {self.running} running: "
                "each batch must be finished once, with accepted <= admitted"
            )
        self.ended(n_admitted)
        self.accepted += n_accepted

    def ended(self, n_admitted: int) -> None:
        """A generation batch ended, where `accepted` is kept elsewhere (the launcher's
        Coordinator sets it from the experience stream, which counts what was put)."""
        if not 0 <= n_admitted <= self.running:
            raise ValueError(f"ended({n_admitted}) with {self.running} running: each batch ends once")
        self.running -= n_admitted

    def step_trained(self, fresh: int) -> None:
        """A learner step trained `fresh` samples for the first time, the rest of its batch
        re-used from replay (learner.max_reuse > 1). Every sample not yet trained then trains
        batch_size - fresh places later than counted: count the shortfall as accepted, so the
        bound keeps holding."""
        if not 0 <= fresh <= self.batch_size:
            raise ValueError(f"step_trained({fresh}): a step trains 0..{self.batch_size} fresh samples")
        self.accepted += self.batch_size - fresh

    def forget(self, n: int) -> None:
        """n accepted samples were dropped before training (stale or malformed): free their slots."""
        if not 0 <= n <= self.accepted:
            raise ValueError(f"forget({n}) with {self.accepted} accepted")
        self.accepted -= n


def lagged_version(received: Iterable[int], newest: int, lag: int) -> int:
    """Of the versions a generator has received, the one to generate with when `newest` arrived
    and generator.weight_lag = lag: the newest at most newest - lag, so that what it makes is
    trained exactly `lag` versions later (the gate admits one batch per version), or, if it has
    none that old (it joined late), the oldest it has: never one it will not receive."""
    versions = list(received)
    older = [v for v in versions if v <= newest - lag]
    return max(older) if older else min(versions)
