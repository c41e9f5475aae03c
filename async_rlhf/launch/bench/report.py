"""`async-rlhf bench`'s report: each job's rates over its timed window (from metrics.jsonl and
summary.json), the verdicts against the issue's targets, bench.md and bench.png. See
async_rlhf/launch/bench/jobs.py for what is measured."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

GEN_LOOP = ("generate_s", "idle_s", "weight_update_s")  # the generator's engine loop time
REWARD_TARGETS = (0.5, 0.8, 0.9)  # policy rewards whose time from the command is reported


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


def summarise(run_dir: Path, warmup: int) -> dict[str, Any]:
    """Rates over the timed window of one job, from its metrics.jsonl and summary.json."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(rows) <= warmup:
        raise RuntimeError(f"{run_dir}: {len(rows)} steps recorded, the warm-up alone is {warmup}")
    first = rows[warmup - 1] if warmup else {"time": 0.0, "gen_totals": {}}
    window, last = rows[warmup:], rows[-1]
    dt = last["time"] - first["time"]
    gen = {k: last["gen_totals"].get(k, 0.0) - first["gen_totals"].get(k, 0.0)
           for k in (*GEN_LOOP, "tokens")}
    gen_loop = sum(gen[k] for k in GEN_LOOP)
    summary = json.loads((run_dir / "summary.json").read_text())
    if not gen_loop:  # steps shorter than the launcher's 1 s tick: whole-run generator totals
        gen = {k: sum(g.get(k, 0.0) for g in summary["generators"]) for k in (*GEN_LOOP, "tokens")}
        gen_loop, dt_gen = sum(gen[k] for k in GEN_LOOP), summary["wall_s"]
    else:
        dt_gen = dt
    generators = summary["generators"]  # whole job: what the launcher's per-step totals lack
    hist: Counter[int] = Counter()
    for r in window:
        hist.update({int(k): v for k, v in r["staleness_hist"].items()})
    tail = rows[-max(1, len(rows) // 4):]
    made = {0: (0, 0.0)}  # policy version -> (samples trained to make it, time it was made)
    samples = 0
    for r in rows:
        samples += r["samples"]
        made[r["version"]] = (samples, r["time"])
    earned: dict[int, list[float]] = {}  # version -> [samples it generated, their reward sum]
    for r in rows:
        for v, (n, mean) in r["reward_by_version"].items():
            acc = earned.setdefault(int(v), [0, 0.0])
            acc[0] += n
            acc[1] += n * mean
    policy_curve = [{"version": v, "samples": made[v][0], "time": made[v][1], "reward": s / n, "n": n}
                    for v, (n, s) in sorted(earned.items())]
    return {
        "timed_steps": len(window),
        "window_s": dt,
        "samples_per_s": sum(r["samples"] for r in window) / dt,
        "trained_tokens_per_s": sum(r["tokens"] for r in window) / dt,
        "tokens_per_s": gen["tokens"] / dt_gen,  # generated response tokens
        "gen_tokens_per_step_s": gen["tokens"] / gen["generate_s"] if gen["generate_s"] else float("nan"),
        "gen_idle": gen["idle_s"] / gen_loop if gen_loop else float("nan"),
        "gen_mean_inflight": _mean([g.get("mean_inflight", 0.0) for g in generators]),
        "gen_inflight_updates": sum(g.get("inflight_updates", 0) for g in generators),
        "gen_weight_updates": sum(g.get("weight_updates", 0) for g in generators),
        "staleness_mean": sum(int(k) * v for k, v in hist.items()) / max(1, sum(hist.values())),
        "staleness_token_mean": _mean([r["staleness_token_mean"] for r in window
                                       if "staleness_token_mean" in r]),
        "learner_idle": sum(r["time_wait"] for r in window) / dt,
        "weight_sync_share": sum(r["weight_sync_share"] for r in window) / len(window),
        "step_s": dt / len(window),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "reward_final": sum(r["reward_mean"] for r in tail) / len(tail),
        "policy_curve": policy_curve,
        "accounting": {k: summary.get(k) for k in ("produced", "trained", "dropped_stale", "lost")},
        # seconds since the command started (the train process's start)
        "first_step_s": rows[0]["time"],
        "reward_s": {str(t): time_to_reward(policy_curve, t) for t in REWARD_TARGETS},
        "startup": summary.get("startup", {}),
        "shutdown_s": summary.get("shutdown_s"),
        "placement_chosen": summary.get("placement", "manual"),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


# -- report --------------------------------------------------------------------------------
def baseline(runs: list[dict]) -> dict | None:
    """The strongest synchronous setting: the k = 0 run that trained the most samples/s."""
    sync = [r for r in runs if r["max_staleness"] == 0]
    return max(sync, key=lambda r: r["samples_per_s"]) if sync else None


def _best_async(runs: list[dict]) -> dict | None:
    cands = [r for r in runs if r["max_staleness"] > 0]
    return max(cands, key=lambda r: r["samples_per_s"]) if cands else None


def verdicts(runs: list[dict], bounds: dict) -> dict[str, Any]:
    """The issue's targets, computed from this run: ratios against the baseline (the strongest
    synchronous setting), plus overlap on one placement (the dedicated k = 0 run with the best
    asynchronous one's generator count) and k = 2 against k = 0 per generator count."""
    best, base = _best_async(runs), baseline(runs)
    v: dict[str, Any] = {"baseline": base and base["name"], "best_async": best and best["name"]}
    if base:  # the learner alone runs learner.threads threads (the config's: 1 in bench.yaml)
        v["baseline_of_train_bound"] = base["samples_per_s"] / bounds["train"]["samples_per_s"]
    if best and base:
        v["speedup_vs_baseline"] = best["samples_per_s"] / base["samples_per_s"]
        t_best, t_base = best["reward_s"]["0.9"], base["reward_s"]["0.9"]
        v["reward_0.9_speedup_vs_baseline"] = t_base / t_best if t_best and t_base else None
        v["reward_per_sample_vs_baseline"] = _ratio(_reward_per_sample(best, base),
                                                    _reward_per_sample(base, best))
    if best:
        v["fraction_of_bound"] = best["samples_per_s"] / bounds["min_samples_per_s"]
        v["fraction_of_packed"] = best["samples_per_s"] / bounds["packed_samples_per_s"]
        same = next((r for r in runs if r["placement"] == "dedicated" and r["max_staleness"] == 0
                     and r["generators"] == best["generators"]), None)
        if same:
            v["speedup_vs_sync_same_placement"] = best["samples_per_s"] / same["samples_per_s"]
    v["gen_tokens_of_engine"] = bounds["gen_tokens_of_engine"]
    dedicated = [r for r in runs if r["placement"] == "dedicated"]
    for g in sorted({r["generators"] for r in dedicated}):
        k0 = next((r for r in dedicated if r["max_staleness"] == 0 and r["generators"] == g), None)
        k2 = next((r for r in dedicated if r["max_staleness"] == 2 and r["generators"] == g), None)
        if k0 and k2:
            v[f"reward_k2_over_k0_g{g}"] = _ratio(k2["reward_final"], k0["reward_final"])
            v[f"reward_per_sample_k2_over_k0_g{g}"] = _ratio(_reward_per_sample(k2, k0),
                                                              _reward_per_sample(k0, k2))
    return v


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _reward_per_sample(run: dict, other: dict) -> float:
    """Mean reward of `run`'s policies over the versions both runs reached: the area under its
    reward-vs-trained-samples curve up to the samples both trained, read per policy version (a
    batch's mean reward would instead lag by the batch's staleness)."""
    common = {p["version"] for p in other["policy_curve"]}
    rewards = [p["reward"] for p in run["policy_curve"] if p["version"] in common]
    return sum(rewards) / len(rewards) if rewards else float("nan")


def write_markdown(report: dict, path: Path) -> None:
    b = report["bounds"]
    lines = [f"# async-rlhf bench: `{report['command']}`", "",
             f"{report['cpus']} cores; {report['timed_steps']} timed learner steps per setting after "
             f"{report['warmup']} warm-up steps; samples per step {report['batch_size']}.", ""]
    measured = "; ".join(f"{m['gen']['when']}: {m['gen']['samples_per_s']:.2f} and "
                         f"{m['train']['samples_per_s']:.2f}" for m in b["measurements"])
    lines += [f"Stage bounds (the faster of two measurements; {measured}): generation alone "
              f"{b['gen']['samples_per_s']:.2f} samples/s ({b['gen']['threads']} thread(s)), training alone "
              f"{b['train']['samples_per_s']:.2f} samples/s ({b['train']['threads']} thread(s)); "
              f"min {b['min_samples_per_s']:.2f}.", ""]
    lines += [f"Generator alone {b['gen']['tokens_per_s']:.0f} tokens/s (mean "
              f"{b['gen']['mean_inflight']:.1f} sequences in flight) vs its engine alone at "
              f"{b['engine']['inflight']} in flight {b['engine']['tokens_per_s']:.0f} tokens/s (mean "
              f"{b['engine']['mean_inflight']:.1f}): {b['gen_tokens_of_engine']:.0%}.", ""]
    lines += ["| setting | mode | k | gens | samples/s | of bound | gen tok/s | gen tok/s stepping | "
              "gen idle | in flight | in-flight updates | learner idle | sync share | staleness mean "
              "| token staleness | staleness hist | reward end | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        frac = f"{r['fraction_of_bound']:.0%}" if r.get("fraction_of_bound") is not None else "-"
        hist = " ".join(f"{k}:{v}" for k, v in r["staleness_hist"].items())
        lines.append(f"| {r['name']} | {r['mode'] or '-'} | {r['max_staleness']} | {r['generators']} | "
                     f"{r['samples_per_s']:.2f} | {frac} | {r['tokens_per_s']:.0f} | "
                     f"{r['gen_tokens_per_step_s']:.0f} | {r['gen_idle']:.0%} | "
                     f"{r['gen_mean_inflight']:.1f} | "
                     f"{r['gen_inflight_updates']}/{r['gen_weight_updates']} | "
                     f"{r['learner_idle']:.0%} | {r['weight_sync_share']:.1%} | {r['staleness_mean']:.2f} | "
                     f"{r['staleness_token_mean']:.2f} | {hist} | "
                     f"{r['reward_final']:.3f} | {r['load_before']}->{r['load_after']} |")
    lines += ["", *_from_the_command(report)]
    lines += ["", "Allocation: " + "; ".join(f"{r['name']}: {r['allocation']}" for r in report["runs"]), ""]
    lines += ["Targets: " + ", ".join(f"{k} = {v:.2f}" if isinstance(v, float) else f"{k} = {v}"
                                      for k, v in report["verdicts"].items()), ""]
    path.write_text("\n".join(lines))


def _from_the_command(report: dict) -> list[str]:
    """The table of times from the command's start (the train process's), with each setting's
    ratio to the baseline."""
    base = next((r for r in report["runs"] if r["name"] == report["verdicts"]["baseline"]), None)

    def secs(t: float | None) -> str:
        return "-" if t is None else f"{t:.1f}"

    def times(r: dict, t: float | None, t_base: float | None) -> str:
        return secs(t) + (f" ({t_base / t:.2f}x)" if t and t_base and r is not base else "")

    targets = [str(t) for t in REWARD_TARGETS]
    lines = [f"The baseline is the strongest synchronous setting: {base['name'] if base else '-'}. Times "
             "are seconds from the command's start; (Nx): how many times faster than the baseline (its "
             "time over the setting's; the setting's rate over its). Policy rewards are read on the "
             "policy curve, each policy's mean reward smoothed with its neighbours' (versions "
             "v-1..v+1, weighted by the samples each generated).",
             "", "| setting | samples/s | first step | " + " | ".join(f"reward {t}" for t in targets)
             + " | end | start-up (seconds since the command) | shutdown |",
             "|---|---|---|" + "---|" * len(targets) + "---|---|---|"]
    for r in report["runs"]:
        rate = f"{r['samples_per_s']:.2f}" + (f" ({r['samples_per_s'] / base['samples_per_s']:.2f}x)"
                                              if base and r is not base else "")
        startup = ", ".join(f"{k} {v:.1f}" for k, v in r["startup"].items())
        rewards = " | ".join(times(r, r["reward_s"][t], base and base["reward_s"][t]) for t in targets)
        lines.append(f"| {r['name']}{' (baseline)' if r is base else ''} | {rate} | "
                     f"{times(r, r['first_step_s'], base and base['first_step_s'])} | {rewards} | "
                     f"{times(r, r['job_wall_s'], base and base['job_wall_s'])} | {startup} | "
                     f"{secs(r['shutdown_s'])} |")
    return lines


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    names = [r["name"] for r in runs]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    ax.bar(names, [r["samples_per_s"] for r in runs], color=["C1" if r["placement"] == "colocated" else
                                                            ("C0" if r["max_staleness"] else "C7") for r in runs])
    ax.axhline(report["bounds"]["min_samples_per_s"], color="k", ls="--", label="stage bound")
    ax.legend()
    ax.set_ylabel("trained samples / s")
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    ax = axes[0][1]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["gen_idle"] for r in runs], width=0.4, label="generator idle")
    ax.bar([i + 0.2 for i in x], [r["learner_idle"] for r in runs], width=0.4, label="learner idle")
    ax.set_xticks(list(x), names, rotation=45, fontsize=7)
    ax.set_ylabel("idle fraction")
    ax.legend()
    for r in runs:
        c = r["policy_curve"]
        axes[1][0].plot([p["samples"] for p in c], [p["reward"] for p in c], label=r["name"])
        axes[1][1].plot([p["time"] for p in c], [p["reward"] for p in c], label=r["name"])
    axes[1][0].set_xlabel("samples trained to make the policy")
    axes[1][1].set_xlabel("when the policy was made, seconds from the command's start")
    for ax in axes[1]:
        ax.set_ylabel("mean reward of the policy's samples")
    axes[1][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def save(report: dict, out: Path, stem: str, markdown, plot_to) -> None:
    """OUT/STEM.json, .md (also printed) and .png of a bench or study report."""
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    markdown(report, out / f"{stem}.md")
    plot_to(report, out / f"{stem}.png")
    print((out / f"{stem}.md").read_text())
    print(f"wrote {out / stem}.json, .md and .png in {report['wall_s'] / 60:.1f} min")
