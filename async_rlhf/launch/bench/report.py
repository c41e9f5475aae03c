"""`async-rlhf bench`'s report: each job's rates over its timed window (from metrics.jsonl and
summary.json), the verdicts on the targets jobs.py declares, bench.md and bench.png. See
async_rlhf/launch/bench/jobs.py for what is measured."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_rlhf.launch.bench.harness import Target, Verdict, figure
from async_rlhf.launch.bench.stages import Bounds, StageBound
from async_rlhf.launch.metrics import StepRecord
from async_rlhf.messages import GeneratorTotals, JobSummary

REWARD_TARGETS = (0.5, 0.8, 0.9)  # policy rewards whose time from the command is reported


@dataclass(frozen=True)
class Setting:
    """One job to run: its config overrides, and the setting its own verdicts compare it with."""

    name: str
    placement: str  # colocated, dedicated or auto
    max_staleness: int
    overrides: tuple[str, ...]
    allocation: str
    mode: str = ""  # a --modes name, or "" for the config's
    generators: int | None = None  # None: placement: auto chooses (filled in once it has)
    generator_threads: int | None = None
    learner_threads: int | None = None
    learner_ranks: int | None = None
    against: str | None = None  # the setting this one is compared with


@dataclass(frozen=True)
class Window:
    """One job over its timed window (after the warm-up steps) and, where marked, as a whole."""

    timed_steps: int
    window_s: float
    samples_per_s: float
    trained_tokens_per_s: float
    tokens_per_s: float
    gen_tokens_per_step_s: float
    gen_idle: float
    gen_mean_inflight: float
    gen_inflight_updates: int
    gen_weight_updates: int
    staleness_mean: float
    staleness_token_mean: float
    learner_idle: float
    weight_sync_share: float
    step_s: float
    staleness_hist: dict[str, int]
    reward_final: float
    policy_curve: list[dict]
    accounting: dict[str, Any]
    first_step_s: float
    reward_s: dict[str, float | None]
    startup: dict[str, float]
    shutdown_s: float | None
    placement_chosen: str


@dataclass(frozen=True)
class Run:
    setting: Setting  # as run: for placement: auto, what the job chose
    window: Window
    job_wall_s: float  # from the command to its exit
    load_before: str
    load_after: str


@dataclass(frozen=True)
class BenchReport:
    command: str
    config: str
    overrides: list[str]
    cpus: int
    warmup: int
    timed_steps: int
    batch_size: int
    wall_s: float
    bounds: Bounds
    runs: list[Run]
    baseline: str | None  # the strongest synchronous setting's name
    best_async: str | None
    verdicts: list[Verdict]


def smoothed(curve: list[dict]) -> list[float]:
    """The policy curve's rewards smoothed: each policy's with its neighbours' (versions v-1, v,
    v+1), weighted by the samples each generated (`n`; a policy that generated few is noisy)."""
    out = []
    for i in range(len(curve)):
        near = curve[max(0, i - 1):i + 2]
        out.append(sum(p["n"] * p["reward"] for p in near) / sum(p["n"] for p in near))
    return out


def time_to_reward(curve: list[dict], target: float) -> float | None:
    """When the first policy whose smoothed reward reaches `target` was made (its `time`, from
    the command's start); None if none did."""
    return next((p["time"] for p, r in zip(curve, smoothed(curve)) if r >= target), None)


def summarise(run_dir: Path, warmup: int) -> Window:
    """Rates over the timed window of one job, from its metrics.jsonl and summary.json."""
    rows = [StepRecord.from_json(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(rows) <= warmup:
        raise RuntimeError(f"{run_dir}: {len(rows)} steps recorded, the warm-up alone is {warmup}")
    first_time, first_totals = (rows[warmup - 1].time, rows[warmup - 1].gen_totals) if warmup else (0.0, GeneratorTotals())
    window, last = rows[warmup:], rows[-1]
    dt = last.time - first_time
    gen = last.gen_totals.minus(first_totals)
    summary = JobSummary.from_json(json.loads((run_dir / "summary.json").read_text()))
    generators = summary.generators  # whole job: what the launcher's per-step totals lack
    dt_gen = dt
    if not gen.engine_loop_s:  # steps shorter than the launcher's 1 s tick: whole-run generator totals
        gen, dt_gen = GeneratorTotals.of(generators), summary.wall_s
    hist: Counter[int] = Counter()
    for r in window:
        hist.update(r.metrics.staleness_hist)
    tail = rows[-max(1, len(rows) // 4):]
    made, samples = {0: (0, 0.0)}, 0  # policy version -> (samples trained to make it, time it was made)
    for r in rows:
        samples += r.metrics.samples
        made[r.metrics.version] = (samples, r.time)
    earned: dict[int, list[float]] = {}  # version -> [samples it generated, their reward sum]
    for r in rows:
        for v, (n, mean) in r.metrics.reward_by_version.items():
            acc = earned.setdefault(v, [0, 0.0])
            acc[0] += n
            acc[1] += n * mean
    policy_curve = [{"version": v, "samples": made[v][0], "time": made[v][1], "reward": s / n, "n": n}
                    for v, (n, s) in sorted(earned.items())]
    acc = summary.accounting
    return Window(
        timed_steps=len(window),
        window_s=dt,
        samples_per_s=sum(r.metrics.samples for r in window) / dt,
        trained_tokens_per_s=sum(r.metrics.tokens for r in window) / dt,
        tokens_per_s=gen.tokens / dt_gen,  # generated response tokens
        gen_tokens_per_step_s=gen.tokens / gen.generate_s if gen.generate_s else float("nan"),
        gen_idle=gen.idle_s / gen.engine_loop_s if gen.engine_loop_s else float("nan"),
        gen_mean_inflight=_mean([g.mean_inflight for g in generators]),
        gen_inflight_updates=sum(g.inflight_updates for g in generators),
        gen_weight_updates=sum(g.weight_updates for g in generators),
        staleness_mean=sum(k * v for k, v in hist.items()) / max(1, sum(hist.values())),
        staleness_token_mean=_mean([r.metrics.staleness_token_mean for r in window]),
        learner_idle=sum(r.metrics.times.wait for r in window) / dt,
        weight_sync_share=sum(r.weight_sync_share for r in window) / len(window),
        step_s=dt / len(window),
        staleness_hist={str(k): hist[k] for k in sorted(hist)},
        reward_final=sum(r.metrics.reward_mean for r in tail) / len(tail),
        policy_curve=policy_curve,
        accounting={"produced": acc.produced, "trained": acc.trained, "dropped_stale": acc.dropped_stale,
                    "lost": acc.lost} if acc else dict.fromkeys(("produced", "trained", "dropped_stale", "lost")),
        # seconds since the command started (the train process's start)
        first_step_s=rows[0].time,
        reward_s={str(t): time_to_reward(policy_curve, t) for t in REWARD_TARGETS},
        startup=dict(summary.startup),
        shutdown_s=summary.shutdown_s,
        placement_chosen=summary.placement,
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


# -- verdicts ------------------------------------------------------------------------------
def baseline(runs: list[Run]) -> Run | None:
    """The strongest synchronous setting: the k = 0 run that trained the most samples/s."""
    return max((r for r in runs if r.setting.max_staleness == 0), key=lambda r: r.window.samples_per_s,
               default=None)


def best_async(runs: list[Run]) -> Run | None:
    return max((r for r in runs if r.setting.max_staleness > 0), key=lambda r: r.window.samples_per_s,
               default=None)


def verdicts(targets: list[Target], runs: list[Run], bounds: Bounds) -> list[Verdict]:
    """Each target's ratio. Its sides name a setting, a role (baseline: the strongest synchronous
    setting; best_async; sync_same_placement: the dedicated k = 0 run with the best asynchronous
    one's generator count) or a stage bound (bound:gen, bound:engine, bound:train, bound:min,
    the slower of generation and training, and bound:packed, in samples/s)."""
    best = best_async(runs)
    same = best and next((r for r in runs if r.setting.placement == "dedicated"
                          and r.setting.max_staleness == 0 and r.setting.generators == best.setting.generators),
                         None)
    sides: dict[str, Run | StageBound | float | None] = {
        **{r.setting.name: r for r in runs}, "baseline": baseline(runs), "best_async": best,
        "sync_same_placement": same, "bound:gen": bounds.gen, "bound:engine": bounds.engine,
        "bound:train": bounds.train, "bound:min": bounds.min_samples_per_s,
        "bound:packed": bounds.packed_samples_per_s}
    return [t.judge(ratio(t.metric, sides.get(t.run), sides.get(t.against))) for t in targets]


def ratio(metric: str, a: Any, b: Any) -> float | None:
    """`metric` of a over that of b; for a time (time_to_reward_R) b's over a's, how many times
    sooner; None when either is missing or b's is zero."""
    if a is None or b is None:
        return None
    if metric == "reward_per_sample":
        x, y = _reward_per_sample(a, b), _reward_per_sample(b, a)
    elif metric.startswith("time_to_reward_"):
        y, x = (r.window.reward_s[metric.removeprefix("time_to_reward_")] for r in (a, b))
    else:
        x, y = (_metric(side, metric) for side in (a, b))
    return x / y if x is not None and y else None


def _metric(side: Run | StageBound | float, metric: str) -> float:
    if isinstance(side, float):  # a bound given as samples/s alone
        return side
    return getattr(side.window if isinstance(side, Run) else side, metric)


def _reward_per_sample(run: Run, other: Run) -> float:
    """Mean reward of `run`'s policies over the versions both runs reached: the area under its
    reward-vs-trained-samples curve up to the samples both trained, read per policy version (a
    batch's mean reward would instead lag by the batch's staleness)."""
    common = {p["version"] for p in other.window.policy_curve}
    rewards = [p["reward"] for p in run.window.policy_curve if p["version"] in common]
    return sum(rewards) / len(rewards) if rewards else float("nan")


# -- bench.md and bench.png ----------------------------------------------------------------
def write_markdown(report: BenchReport, path: Path) -> None:
    b = report.bounds
    lines = [f"# async-rlhf bench: `{report.command}`", "",
             f"{report.cpus} cores; {report.timed_steps} timed learner steps per setting after "
             f"{report.warmup} warm-up steps; samples per step {report.batch_size}.", ""]
    measured = "; ".join(f"{m['gen'].when}: {m['gen'].samples_per_s:.2f} and {m['train'].samples_per_s:.2f}"
                         for m in b.measurements)
    lines += [f"Stage bounds (the faster of two measurements; {measured}): generation alone "
              f"{b.gen.samples_per_s:.2f} samples/s ({b.gen.threads} thread(s)), training alone "
              f"{b.train.samples_per_s:.2f} samples/s ({b.train.threads} thread(s)); "
              f"min {b.min_samples_per_s:.2f}.", ""]
    lines += [f"Generator alone {b.gen.tokens_per_s:.0f} tokens/s (mean {b.gen.mean_inflight:.1f} "
              f"sequences in flight) vs its engine alone at {b.engine.detail['inflight']} in flight "
              f"{b.engine.tokens_per_s:.0f} tokens/s (mean {b.engine.mean_inflight:.1f}): "
              f"{b.gen.tokens_per_s / b.engine.tokens_per_s:.0%}.", ""]
    lines += ["| setting | mode | k | gens | samples/s | of bound | gen tok/s | gen tok/s stepping | "
              "gen idle | in flight | in-flight updates | learner idle | sync share | staleness mean "
              "| token staleness | staleness hist | reward end | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.runs:
        s, w = r.setting, r.window
        frac = f"{w.samples_per_s / b.min_samples_per_s:.0%}" if s.placement == "dedicated" else "-"
        hist = " ".join(f"{k}:{v}" for k, v in w.staleness_hist.items())
        lines.append(f"| {s.name} | {s.mode or '-'} | {s.max_staleness} | {s.generators} | "
                     f"{w.samples_per_s:.2f} | {frac} | {w.tokens_per_s:.0f} | {w.gen_tokens_per_step_s:.0f} | "
                     f"{w.gen_idle:.0%} | {w.gen_mean_inflight:.1f} | "
                     f"{w.gen_inflight_updates}/{w.gen_weight_updates} | {w.learner_idle:.0%} | "
                     f"{w.weight_sync_share:.1%} | {w.staleness_mean:.2f} | {w.staleness_token_mean:.2f} | "
                     f"{hist} | {w.reward_final:.3f} | {r.load_before}->{r.load_after} |")
    lines += ["", *_from_the_command(report)]
    lines += ["", "Allocation: " + "; ".join(f"{r.setting.name}: {r.setting.allocation}" for r in report.runs), ""]
    lines += ["Verdicts: baseline = {}, best_async = {}; ".format(report.baseline, report.best_async)
              + ", ".join(map(str, report.verdicts)), ""]
    path.write_text("\n".join(lines))


def _from_the_command(report: BenchReport) -> list[str]:
    """The table of times from the command's start (the train process's), with each setting's
    ratio to the baseline."""
    base = next((r for r in report.runs if r.setting.name == report.baseline), None)

    def secs(t: float | None) -> str:
        return "-" if t is None else f"{t:.1f}"

    def times(r: Run, t: float | None, t_base: float | None) -> str:
        return secs(t) + (f" ({t_base / t:.2f}x)" if t and t_base and r is not base else "")

    targets = [str(t) for t in REWARD_TARGETS]
    lines = [f"The baseline is the strongest synchronous setting: {report.baseline or '-'}. Times "
             "are seconds from the command's start; (Nx): how many times faster than the baseline (its "
             "time over the setting's; the setting's rate over its). Policy rewards are read on the "
             "policy curve, each policy's mean reward smoothed with its neighbours' (versions "
             "v-1..v+1, weighted by the samples each generated).",
             "", "| setting | samples/s | first step | " + " | ".join(f"reward {t}" for t in targets)
             + " | end | start-up (seconds since the command) | shutdown |",
             "|---|---|---|" + "---|" * len(targets) + "---|---|---|"]
    bw = base.window if base else None
    for r in report.runs:
        w = r.window
        rate = f"{w.samples_per_s:.2f}" + (f" ({w.samples_per_s / bw.samples_per_s:.2f}x)"
                                           if bw and r is not base else "")
        startup = ", ".join(f"{k} {v:.1f}" for k, v in w.startup.items())
        rewards = " | ".join(times(r, w.reward_s[t], bw and bw.reward_s[t]) for t in targets)
        lines.append(f"| {r.setting.name}{' (baseline)' if r is base else ''} | {rate} | "
                     f"{times(r, w.first_step_s, bw and bw.first_step_s)} | {rewards} | "
                     f"{times(r, r.job_wall_s, base and base.job_wall_s)} | {startup} | "
                     f"{secs(w.shutdown_s)} |")
    return lines


def plot(report: BenchReport, path: Path) -> None:
    from matplotlib.patches import Patch

    runs = report.runs
    names = [r.setting.name for r in runs]
    colors = {"colocated": "C1", "synchronous": "C7", "asynchronous": "C0"}  # legend label -> bar colour
    with figure(path, 2, 2, figsize=(12, 8)) as axes:
        axes[0][0].figure.suptitle(f"async-rlhf bench: {report.config}, {report.cpus} cores, "
                                   f"{report.timed_steps} timed steps per setting after {report.warmup} warm-up")
        ax = axes[0][0]
        ax.bar(names, [r.window.samples_per_s for r in runs],
               color=[colors["colocated" if r.setting.placement == "colocated" else
                             "asynchronous" if r.setting.max_staleness else "synchronous"] for r in runs])
        bound = ax.axhline(report.bounds.min_samples_per_s, color="k", ls="--",
                           label="stage bound (the slower stage alone)")
        top = max(report.bounds.min_samples_per_s, *(r.window.samples_per_s for r in runs))
        ax.set_ylim(0, 1.4 * top)  # room for the legend above the bars and the bound
        ax.legend(handles=[*(Patch(color=c, label=f"{k} (k {'> 0' if k == 'asynchronous' else '= 0'})")
                             for k, c in colors.items()), bound], fontsize=7, ncol=2, loc="upper left")
        ax.set_xlabel("setting")
        ax.set_ylabel("trained samples / s")
        ax.set_title("Throughput by setting")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
        ax = axes[0][1]
        x = range(len(runs))
        ax.bar([i - 0.2 for i in x], [r.window.gen_idle for r in runs], width=0.4, label="generator idle")
        ax.bar([i + 0.2 for i in x], [r.window.learner_idle for r in runs], width=0.4, label="learner idle")
        ax.set_xticks(list(x), names, rotation=45, fontsize=7)
        ax.set_xlabel("setting")
        ax.set_ylabel("fraction of the timed window idle")
        ax.set_title("Idle time of each stage")
        ax.legend()
        for r in runs:  # a marker at each policy: a run that made one policy still shows
            c = r.window.policy_curve
            for ax, x_key in zip(axes[1], ("samples", "time")):
                ax.plot([p[x_key] for p in c], [p["reward"] for p in c], "o-", markersize=3, label=r.setting.name)
        axes[1][0].set_xlabel("samples trained to make the policy")
        axes[1][1].set_xlabel("when the policy was made, seconds from the command's start")
        axes[1][0].set_title("Reward by samples trained")
        axes[1][1].set_title("Reward by wall time")
        for ax in axes[1]:
            ax.set_ylabel("mean reward of the policy's samples")
        axes[1][1].legend(fontsize=7)
