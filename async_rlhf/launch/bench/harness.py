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


@dataclass(frozen=True)
class Verdict:
    target: Target
    value: float | None  # None: one side is missing (no such run, a reward never reached)

    @property
    def met(self) -> bool | None:
        t = self.target
        if self.value is None or (t.at_least is None and t.at_most is None):
            return None
        return (t.at_least is None or self.value >= t.at_least) and (t.at_most is None or self.value <= t.at_most)

    def __str__(self) -> str:
        t = self.target
        value = "-" if self.value is None else f"{self.value:.2f}"
        wanted = " and ".join(([f">= {t.at_least}"] if t.at_least is not None else [])
                              + ([f"<= {t.at_most}"] if t.at_most is not None else []))
        verdict = {True: "met", False: "NOT met", None: ""}[self.met]
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
    data = _plain(report)
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


def _plain(value: Any) -> Any:
    """Dataclasses as dicts (a Verdict with its `met` too), all the way down."""
    if isinstance(value, Verdict):
        return {**dataclasses.asdict(value.target), "value": value.value, "met": value.met}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


if __name__ == "__main__":  # in_child's process: one pickled call, its result pickled back
    fn, args = pickle.loads(Path(sys.argv[1]).read_bytes())
    Path(sys.argv[2]).write_bytes(pickle.dumps(fn(*args)))
