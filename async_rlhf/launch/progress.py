"""A progress bar with an ETA for long commands (train, bench, study), shown only when the output
is a terminal: a log file or a pipe gets the plain lines it always got."""

from __future__ import annotations

import sys
import time


def eta_text(seconds: float) -> str:
    """90 -> '1m30s', 3725 -> '1h02m', 42.4 -> '42s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """`done` of `total` units, the ETA from the mean time per unit since `start` (the first
    unit's start: start-up before it is not extrapolated). `shown`: whether to show it at all."""

    def __init__(self, total: int, unit: str, *, start: float | None = None, shown: bool | None = None,
                 width: int = 20):
        self.total, self.unit, self.width = total, unit, width
        self.start = time.monotonic() if start is None else start
        self.shown = sys.stdout.isatty() if shown is None else shown

    def bar(self, done: int, now: float | None = None) -> str:
        """'[#####...............] 15/60 steps, eta 1m30s' ('' when not shown)."""
        if not self.shown:
            return ""
        filled = self.width * done // self.total if self.total else self.width
        text = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {self.unit}"
        elapsed = (time.monotonic() if now is None else now) - self.start
        if 0 < done < self.total:
            text += f", eta {eta_text(elapsed / done * (self.total - done))}"
        return text
