"""The generators' progress watchdog: a generator whose engine takes no step and loads no
weights for `stall_s` while it has work (sequences in its engine, or a weight update waiting)
has a hung engine loop. Its process still answers the launcher's stats
calls (they run in another thread), so without this nothing would notice; the launcher then
kills and replaces it as it does a dead one (slots released, its prompts continued)."""

from __future__ import annotations


class StallWatch:
    """Per generator, its progress last seen (engine steps + weight updates loaded) and since
    when (monotonic seconds)."""

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self._since: dict[str, tuple[int, float]] = {}  # generator id -> (progress, first seen at)

    def stalled(self, generator_id: str, progress: int, sequences: int, updates: int, now: float) -> str:
        """Why the generator counts as stalled at `now`, or "" if it does not: `progress` is
        its engine steps plus its weight updates loaded, `sequences` what its engine holds,
        `updates` the weight updates waiting for it or loading. With neither it has no work,
        so it never stalls (the gate may hold it back for as long as the learner needs)."""
        seen = self._since.get(generator_id)
        if seen is None or seen[0] != progress or not (sequences or updates):
            self._since[generator_id] = (progress, now)
            return ""
        if now - seen[1] < self.stall_s:
            return ""
        return (f"stalled: no engine step or weight load for {now - seen[1]:.0f} s with {sequences} "
                f"sequences in its engine and {updates} weight updates waiting "
                f"(generator.stall_s={self.stall_s:g})")

    def forget(self, generator_id: str) -> None:
        """The generator is gone: its replacement starts from its own first report."""
        self._since.pop(generator_id, None)
