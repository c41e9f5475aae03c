"""The bench harness every benchmark runs on (nanoGPT's bench.py is the model):

- `in_child(fn, *args)`: a measurement in a fresh Python process (`python -m` this module runs
  one pickled call), so an engine that pins its process's threads, or a stage measured alone,
  starts clean; its output goes to a log, its result comes back as the object `fn` returned.
- `warm_then_time(step, ...)`: untimed warm-up calls, then timed ones.
- `Target` / `Verdict`: a ratio the report states, what it compares against, and the range that
  meets it, declared with the settings rather than written into the comparisons.
- `figure(path)` and `save(report, path)`: the plot and the JSON / Markdown / PNG files.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from async_rlhf.procs import run_child

T = TypeVar("T")


def in_child(fn: Callable[..., T], *args: Any, log: Path, timeout_s: float = 900) -> T:
    """`fn(*args)` in a fresh process, its output into `log`; what it returned (pickled back).
    `fn` must be a module-level function and its arguments picklable."""
    call, result = log.with_suffix(".call.pkl"), log.with_suffix(".result.pkl")
    call.write_bytes(pickle.dumps((fn, args)))
    result.unlink(missing_ok=True)
    code = run_child([sys.executable, "-m", __name__, str(call), str(result)], log, timeout_s)
    if code != 0 or not result.exists():
        raise RuntimeError(f"{fn.__name__} failed in its own process (exit {code}); see {log}")
    value = pickle.loads(result.read_bytes())
    call.unlink()
    result.unlink()
    return value


def warm_then_time(step: Callable[[], T], *, warmup: int, repeats: int) -> list[tuple[float, T]]:
    """`step()` `warmup` times untimed, then `repeats` times timed: (seconds, result) of each."""
    for _ in range(warmup):
        step()
    timed = []
    for _ in range(repeats):
        start = time.perf_counter()
        value = step()
        timed.append((time.perf_counter() - start, value))
    return timed


@dataclass(frozen=True)
class Target:
    """A ratio a report states: `metric` of `run` over the same of `against` (who they are is
    the report's to resolve: a setting's name, a role such as the baseline, a stage bound). It
    is met when it lies in [at_least, at_most]; with neither, it is reported, not judged."""

    name: str
    metric: str
    run: str
    against: str
    at_least: float | None = None
    at_most: float | None = None

    def judge(self, value: float | None) -> Verdict:
        """The verdict on `value` (None: one side is missing, or a reward never reached)."""
        judged = value is not None and (self.at_least is not None or self.at_most is not None)
        return Verdict(self, value, ((self.at_least is None or value >= self.at_least)
                                     and (self.at_most is None or value <= self.at_most)) if judged else None)


@dataclass(frozen=True)
class Verdict:
    target: Target
    value: float | None
    met: bool | None  # None: reported, not judged

    def __str__(self) -> str:
        t = self.target
        wanted = " and ".join(([f">= {t.at_least}"] if t.at_least is not None else [])
                              + ([f"<= {t.at_most}"] if t.at_most is not None else []))
        verdict = {True: "met", False: "NOT met", None: "-"}[self.met]
        value = "-" if self.value is None else f"{self.value:.2f}"
        return f"{t.name} = {value}" + (f" (target {wanted}: {verdict})" if wanted else "")


@contextmanager
def figure(path: Path, nrows: int = 1, ncols: int = 1, dpi: int = 90, **subplots: Any) -> Iterator[Any]:
    """A matplotlib figure's axes (Agg, no display), saved to `path` and closed after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, **subplots)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def save(report: Any, path: Path, *, markdown: Callable[[Any, Path], None] | None = None,
         plot: Callable[[Any, Path], None] | None = None) -> None:
    """`report` (a dataclass or a dict) as JSON at `path`, and beside it, when given, its
    Markdown (.md, also printed) and plot (.png)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dataclasses.asdict(report) if dataclasses.is_dataclass(report) else report
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    written = [path]
    if markdown:
        markdown(report, path.with_suffix(".md"))
        print(path.with_suffix(".md").read_text())
        written.append(path.with_suffix(".md"))
    if plot:
        plot(report, path.with_suffix(".png"))
        written.append(path.with_suffix(".png"))
    print("wrote " + ", ".join(map(str, written)), flush=True)


if __name__ == "__main__":  # in_child's process: one pickled call, its result pickled back
    fn, args = pickle.loads(Path(sys.argv[1]).read_bytes())
    Path(sys.argv[2]).write_bytes(pickle.dumps(fn(*args)))
