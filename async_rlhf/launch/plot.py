"""`async-rlhf plot RUN [RUN...]`: PNGs of finished (or running) jobs from their OUT/metrics.jsonl,
several runs overlaid with a legend. Each figure has two panels, the same curves over learner
steps and over wall time (seconds from the command); `stage_times.png` has one panel per run.

A RUN may also be the --out of `scripts/trl_baseline.py` (its trl.json): TRL's GRPOTrainer's batch
reward then joins reward.png, read as rows of our schema holding only the fields TRL gives (step,
time, reward_mean); the figures of what it does not record lack its curve."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_rlhf.launch.bench.harness import figure

Row = dict[str, Any]

# file -> (title, y label, [(legend suffix, value of a row or None, line style)])
CURVES: dict[str, tuple[str, str, list[tuple[str, Callable[[Row], float | None], str]]]] = {
    "reward": ("Reward", "mean reward", [
        ("train (batch)", lambda r: r.get("reward_mean"), "-"),
        ("held-out, greedy", lambda r: _eval(r, "eval_reward"), "o--")]),
    "kl": ("KL to the reference policy", "KL estimate, nats per token", [("", lambda r: r.get("kl"), "-")]),
    "entropy": ("Policy entropy", "nats per token", [("", lambda r: r.get("entropy"), "-")]),
    "response_length": ("Response length", "tokens the model sampled", [
        ("mean", lambda r: r.get("response_len_mean"), "-"),
        ("max", lambda r: r.get("response_len_max"), ":")]),
    "staleness": ("Staleness of trained samples", "policy versions old", [
        ("mean", lambda r: r.get("staleness_mean"), "-"), ("max", lambda r: r.get("staleness_max"), ":")]),
    "throughput": ("Throughput", "trained samples / s", [("", lambda r: r.get("samples_per_s"), "-")]),
}

# the learner step's phases, in the order they run (time_<phase> in metrics.jsonl)
PHASES = ("wait", "recompute", "forward", "backward", "step", "weight_gather", "publish", "checkpoint")
# where the generators' seconds go (gen_totals in metrics.jsonl)
GEN_ACTIVITIES = ("generate_s", "score_s", "put_s", "weight_update_s", "idle_s")


def _eval(row: Row, key: str) -> float | None:
    """The newest held-out evaluation finished by this step, if any."""
    evals = row.get("evals") or []
    return evals[-1][key] if evals else None


def read_run(run: Path) -> tuple[str, list[Row]]:
    """The legend label and rows of one run: a train job's metrics.jsonl, or a TRL baseline's
    trl.json as rows of the same schema (step, time, reward_mean)."""
    ours, trl = run / "metrics.jsonl", run / "trl.json"
    if ours.is_file() and trl.is_file():
        raise SystemExit(f"{run} holds both metrics.jsonl and trl.json: give `train` and "
                         "scripts/trl_baseline.py each its own --out")
    if trl.is_file():
        result = json.loads(trl.read_text())
        rows = [{"step": s["step"], "time": s["t"], "reward_mean": s["reward"]} for s in result["steps"]]
        label = f"{run} (TRL GRPOTrainer, {'bf16' if result['bf16'] else 'float32'})"
        path = trl
    elif ours.is_file():
        rows = [json.loads(line) for line in ours.read_text().splitlines() if line.strip()]
        label, path = str(run), ours
    else:
        raise SystemExit(f"{run} holds no metrics.jsonl or trl.json: pass the --out directory of a train "
                         "job or of scripts/trl_baseline.py")
    if not rows:
        raise SystemExit(f"{path} records no step yet: the job has not finished a learner step")
    return label, rows


def plot_runs(runs: dict[str, list[Row]], out: Path) -> list[Path]:
    """Every figure for `runs` (label -> rows) into `out`; the paths written. A figure none of the
    runs has a value for (KL without a reference model) is left out."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, curves) in CURVES.items():
        if not any(get(r) is not None for rows in runs.values() for r in rows for _, get, _ in curves):
            continue
        path = out / f"{name}.png"
        with figure(path, 1, 2, figsize=(11, 4), dpi=100) as axes:
            for (label, rows), color in zip(runs.items(), _colors()):
                for suffix, get, style in curves:
                    points = [(r["step"], r["time"], v) for r in rows if (v := get(r)) is not None]
                    if not points:
                        continue
                    name_ = f"{label} {suffix}".strip() if len(runs) > 1 or suffix else label
                    for ax, x in zip(axes, (0, 1)):
                        ax.plot([p[x] for p in points], [p[2] for p in points], style, color=color,
                                label=name_, markersize=4)
            for ax, xlabel in zip(axes, ("learner step (policy version)", "seconds since the command")):
                ax.set_xlabel(xlabel)
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
            axes[0].set_title(f"{title}, by step")
            axes[1].set_title(f"{title}, by wall time")
            axes[1].legend(fontsize=8)
        written.append(path)
    timed = {label: rows for label, rows in runs.items() if "step_s" in rows[0]}  # train jobs', not TRL's
    if not timed:
        return written
    path = out / "stage_times.png"
    with figure(path, 2, len(timed), figsize=(6.5 * len(timed), 7), dpi=100, squeeze=False, sharey=True) as axes:
        for col, (label, rows) in enumerate(timed.items()):
            steps = [r["step"] for r in rows]
            learner = [[r.get(f"time_{p}", 0.0) / r["step_s"] if r["step_s"] else 0.0 for r in rows] for p in PHASES]
            learner.append([max(0.0, 1.0 - sum(s)) for s in zip(*learner)])
            _stack(axes[0][col], steps, learner, [*PHASES, "other (launcher)"],
                   f"Learner step time by phase: {label}")
            # the generators' seconds in each activity between two of their reports (about one a
            # second: several steps may share one), as shares of their sum
            reports = [r for a, r in zip([None, *rows], rows) if a is None or r["gen_totals"] != a["gen_totals"]]
            deltas = [{k: b["gen_totals"][k] - a["gen_totals"][k] for k in GEN_ACTIVITIES}
                      for a, b in zip(reports, reports[1:])]
            shares = [[d[k] / max(sum(d.values()), 1e-9) for d in deltas] for k in GEN_ACTIVITIES]
            _stack(axes[1][col], [r["step"] for r in reports[1:]], shares, [k[:-2] for k in GEN_ACTIVITIES],
                   f"Generators' time by activity: {label}")
        for row, who in zip(axes, ("the step's seconds", "the generators' seconds")):
            row[0].set_ylabel(f"share of {who}")
    written.append(path)
    return written


def _stack(ax, steps: list[int], shares: list[list[float]], labels: list[str], title: str) -> None:
    ax.stackplot(steps, shares, labels=labels)
    ax.set_title(title)
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylim(0, 1.0)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _colors():
    i = 0
    while True:
        yield f"C{i % 10}"
        i += 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="train output directories (each with metrics.jsonl) "
                        "or scripts/trl_baseline.py's (with trl.json)")
    parser.add_argument("--out", type=Path, help="where the PNGs go (default: RUN/plots of the first run)")


def run(args: argparse.Namespace) -> int:
    labels = [str(r) for r in args.runs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"each run once, got {' '.join(labels)}")
    runs = dict(read_run(path) for path in args.runs)
    for path in plot_runs(runs, args.out or args.runs[0] / "plots"):
        print(path)
    return 0
