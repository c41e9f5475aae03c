"""The staleness bound k as an admission gate (AReaL's rule) plus the learner-side check.

Samples are trained in the order they are accepted, `batch_size` per learner step. A sample
admitted while the learner is at version V gets an index below (k + V + 1) * batch_size if the
gate admits it only while

    accepted + running + n <= (k + V + 1) * batch_size,

so it is consumed by step (k + V) at the latest: staleness <= k. k = 0 is synchronous on-policy
RL: generation for version V+1 waits until the batch for V has been trained.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessGate:
    """Counts samples admitted for generation; pure logic, no I/O (the launcher shares it)."""

    max_staleness: int
    batch_size: int
    version: int = 0  # current learner policy version
    accepted: int = 0  # samples generated and handed to the queue
    running: int = 0  # samples admitted, still being generated

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {self.batch_size}")

    def capacity(self) -> int:
        """How many more samples may be admitted now."""
        limit = (self.max_staleness + self.version + 1) * self.batch_size
        return max(0, limit - (self.accepted + self.running))

    def try_admit(self, n: int) -> bool:
        """Reserve n samples of generation if the bound allows all of them."""
        if n > self.capacity():
            return False
        self.running += n
        return True

    def finish(self, n_admitted: int, n_accepted: int) -> None:
        """A generation batch ended: n_accepted of its n_admitted samples reached the queue.

        Samples set aside (a reward that failed, say) free their slot for new work.
        """
        if not 0 <= n_accepted <= n_admitted <= self.running:
            raise ValueError(
                f"finish({n_admitted}, {n_accepted}) with {self.running} running: "
                "each batch must be finished once, with accepted <= admitted"
            )
        self.running -= n_admitted
        self.accepted += n_accepted

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went back from {self.version} to {version}")
        self.version = version

    def forget(self, n: int) -> None:
        """n accepted samples were dropped before training (stale or malformed): free their slots."""
        self.accepted -= n
