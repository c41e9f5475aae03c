"""`async-rlhf bench`: asynchronous vs synchronous training throughput, in one run.

Every setting is a whole `train` job (launcher.Job, in its own process, out dir and job name) on
the same model, task and seed for the same number of learner steps; the first `--warmup` steps
are not counted. Rates come from the job's metrics.jsonl: the timed window runs from the end of
step W to the end of the last step.

    bounds     generation alone: one generator (the real loop: engine, scoring, Redis put)
               with the learner absent, generator.threads threads; training alone: the real
               Learner on DeepSpeed with learner.threads threads, fed those trajectories from
               a Redis stream (cycled, each batch stamped with the version that trains it).
               Each in a fresh process, one after the other; the rest of the machine idle.
               Measured before and after the settings; each stage's bound is the faster of
               its two measurements (neighbours on a shared machine only slow a stage down).
    dedicated  a job with max_staleness=k and g generators: the learner rank and each
               generator are separate processes (Ray actors) on learner.threads and
               generator.threads threads: each stage its own core(s). k = 0 is synchronous.
    colocated  a synchronous (k = 0) job whose learner and one generator each get every core
               (threads = cpu count). At k = 0 they take turns: one phase runs with all cores
               while the other waits (blocked on the gate or on the stream, not spinning), as a
               single-process trainer would, plus the weight broadcast between processes.

Reported per setting: trained samples/s and response tokens/s, generated tokens/s, generator
idle fraction (idle / (idle + generate + score + put + weight load), over the window), learner
idle fraction (time waiting for a batch / window), weight-sync share of the step, staleness
histogram, reward at the end (batch mean over the last quarter of steps), the policy curve (the
mean reward of the samples each policy version generated, against the samples trained to make
that version and the time it was made) and the fraction of min(bound_gen, bound_train) reached.
Reward per sample compares the policy curves of k = 2 and k = 0 over the versions both reached.
Writes OUT/bench.json, OUT/bench.md, OUT/bench.png; each job keeps its own directory under
OUT/runs/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

GEN_TOTALS = ("generate_s", "score_s", "put_s", "idle_s", "weight_update_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config of the job to benchmark")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--staleness", default="0,1,2,4", help="max_staleness values (0 = synchronous)")
    parser.add_argument("--generators", default="1,2", help="generator counts")
    parser.add_argument("--steps", type=int, help="timed learner steps per setting (default: learner.steps)")
    parser.add_argument("--warmup", type=int, default=2, help="learner steps per setting not timed")
    parser.add_argument("--bound-steps", type=int, default=4, help="timed learner steps of the training bound")
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated synchronous run")
    parser.add_argument("--worker", choices=["gen", "train"], help=argparse.SUPPRESS)  # internal
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)  # internal: the bounds' stream
    parser.add_argument("overrides", nargs="*", default=[], help="key=value config overrides")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{name} must be a comma list of integers, e.g. 0,1,2, got {text!r}") from None
    if not values or min(values) < 0:
        raise SystemExit(f"--{name} must list integers >= 0, got {text!r}")
    return values


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


# -- stage bounds (each in its own process) ------------------------------------------------
class _OpenGate:
    """AdmissionGate that always admits: generation with nobody to wait for."""

    def try_admit(self, n: int) -> bool:
        return True

    def finish(self, n_admitted: int, n_accepted: int) -> None:
        pass


def _bound_gen(cfg, redis_url: str, batches: int) -> dict[str, Any]:
    """The generator loop alone, one warm-up batch then `batches` timed, into stream bound-gen."""
    import threading

    from actors.generator import make_generator
    from buffer.redis_stream import RedisExperienceQueue

    queue = RedisExperienceQueue.from_config(cfg.queue, redis_url, consumer="bound-gen")
    gen = make_generator(cfg, queue, _OpenGate())
    gen.step()  # warm-up
    before = gen.stats()
    start = time.perf_counter()
    gen.run(threading.Event(), max_batches=batches)
    wall = time.perf_counter() - start
    after = gen.stats()
    samples, tokens = after["produced"] - before["produced"], after["tokens"] - before["tokens"]
    return {"samples_per_s": samples / wall, "tokens_per_s": tokens / wall, "wall_s": wall,
            "samples": samples, "threads": cfg.generator.threads,
            "generate_share": (after["generate_s"] - before["generate_s"]) / wall}


def _bound_train(cfg, redis_url: str, warmup: int, steps: int) -> dict[str, Any]:
    """The learner alone on the bound-gen groups, replayed through stream bound-train."""
    import dataclasses

    import torch

    from buffer.redis_stream import RedisExperienceQueue
    from buffer.replay import StalenessReplay
    from learners.bench import NullPublisher
    from learners.deepspeed_backend import DeepSpeedBackend
    from learners.learner import Learner

    torch.set_num_threads(cfg.learner.threads)
    source = RedisExperienceQueue.from_config(cfg.queue, redis_url, consumer="bound-train")
    groups = []
    while got := source.get(1024, block_ms=100):
        groups += [r.group for r in got]
        source.ack([r.entry_id for r in got], reason="copied")
    batch, total = cfg.learner.batch_size // cfg.generator.group_size, warmup + steps  # groups
    if len(groups) < batch:
        raise RuntimeError(f"training bound: {len(groups)} groups, a batch needs {batch}")
    queue = RedisExperienceQueue.from_config(
        dataclasses.replace(cfg.queue, stream="bound-train"), redis_url, consumer="learner-0")
    for v in range(total):  # cycle the generated data, each batch stamped with its version
        queue.put([groups[(v * batch + i) % len(groups)].with_version(v) for i in range(batch)])
    backend = DeepSpeedBackend(cfg.learner, cfg.model.path, dtype=cfg.model.dtype,
                               temperature=cfg.generator.temperature, seed=cfg.seed)
    learner = Learner(cfg.learner, backend, max_staleness=total, group_size=cfg.generator.group_size,
                      queue=queue, replay=StalenessReplay(max_reuse=1, max_staleness=total),
                      publisher=NullPublisher())
    learner.train(warmup)
    start = time.perf_counter()
    history = learner.train(steps)
    wall = time.perf_counter() - start
    samples = sum(m["samples"] for m in history)
    return {"samples_per_s": samples / wall, "tokens_per_s": sum(m["tokens"] for m in history) / wall,
            "wall_s": wall, "samples": samples, "threads": cfg.learner.threads,
            "step_s": wall / steps,
            "share": {k[5:]: sum(m[k] for m in history) / wall for k in history[0] if k.startswith("time_")}}


def _worker(args: argparse.Namespace) -> int:
    from async_rlhf.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.worker == "gen":
        batches = max(4, 2 * cfg.learner.batch_size // cfg.samples_per_generation)
        result = _bound_gen(cfg, args.redis_url, batches)
    else:
        result = _bound_train(cfg, args.redis_url, args.warmup, args.bound_steps)
    print("BENCH-RESULT " + json.dumps(result))
    return 0


# torch.distributed rendezvous variables: a child is a lone process or a whole job of its own,
# never a member of a group this process (or the shell, under torchrun or SLURM) set up.
_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _spawn(argv: list[str], log_path: Path, timeout_s: float) -> int:
    """Run a child to completion; if we are interrupted or it overruns, stop it (SIGTERM: a job
    stops its generators and Ray cleanly) before going on."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            return proc.wait(timeout_s)
        except BaseException:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def measure_bounds(args: argparse.Namespace, out: Path, when: str) -> dict[str, Any]:
    """Each stage alone, in a fresh process, into OUT/bounds/WHEN/."""
    from buffer.redis_server import EmbeddedRedis

    base = [sys.executable, "-m", "async_rlhf.cli", "bench", "--config", args.config, "--out", str(out),
            "--warmup", str(args.warmup), "--bound-steps", str(args.bound_steps), *args.overrides]
    bounds: dict[str, Any] = {}
    where = out / "bounds" / when
    where.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis(where / "redis") as redis:
        for stage in ("gen", "train"):
            load = _load()
            log_path = where / f"{stage}.log"
            code = _spawn([*base, "--worker", stage, "--redis-url", redis.url], log_path, 900)
            lines = [l for l in log_path.read_text().splitlines() if l.startswith("BENCH-RESULT ")]
            if code != 0 or not lines:
                raise RuntimeError(f"{stage} bound failed (exit {code}); see {log_path}")
            result = json.loads(lines[-1][len("BENCH-RESULT "):])
            bounds[stage] = {**result, "load_before": load, "when": when}
            print(f"bound {stage} ({when} the settings): {bounds[stage]['samples_per_s']:.2f} samples/s "
                  f"({bounds[stage]['threads']} thread(s), load {load})", flush=True)
    return bounds


def best_bounds(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Each stage's faster measurement: on a shared machine a neighbour only ever slows a stage
    down, so the faster one is nearer the stage's real limit (and the stricter bound)."""
    bounds: dict[str, Any] = {stage: max((m[stage] for m in measured), key=lambda b: b["samples_per_s"])
                              for stage in ("gen", "train")}
    bounds["min_samples_per_s"] = min(bounds["gen"]["samples_per_s"], bounds["train"]["samples_per_s"])
    bounds["measurements"] = measured
    return bounds


# -- settings: whole jobs ------------------------------------------------------------------
def settings(args: argparse.Namespace, cfg) -> list[dict[str, Any]]:
    cpus = os.cpu_count() or 1
    out = []
    if not args.no_colocated:
        out.append({"name": "colocated-k0-g1", "placement": "colocated", "max_staleness": 0,
                    "generators": 1, "generator_threads": cpus, "learner_threads": cpus})
    for g in _ints(args.generators, "generators"):
        for k in _ints(args.staleness, "staleness"):
            out.append({"name": f"dedicated-k{k}-g{g}", "placement": "dedicated", "max_staleness": k,
                        "generators": g, "generator_threads": cfg.generator.threads,
                        "learner_threads": cfg.learner.threads})
    for s in out:
        s["allocation"] = (f"{s['generators']} generator process(es) x {s['generator_threads']} thread(s) "
                           f"+ 1 learner process x {s['learner_threads']} thread(s) on {cpus} cores")
    return out


def run_setting(args: argparse.Namespace, s: dict[str, Any], out: Path, steps: int) -> Path:
    run_dir = out / "runs" / s["name"]
    argv = [sys.executable, "-m", "async_rlhf.cli", "train", "--config", args.config, *args.overrides,
            f"job=bench-{s['name']}", f"out={run_dir}", f"max_staleness={s['max_staleness']}",
            f"generator.count={s['generators']}", f"generator.threads={s['generator_threads']}",
            f"learner.threads={s['learner_threads']}", f"learner.steps={args.warmup + steps}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json"):  # a rerun into the same OUT starts afresh
        (run_dir / stale).unlink(missing_ok=True)
    s["load_before"] = _load()
    start = time.time()
    code = _spawn(argv, out / "runs" / f"{s['name']}.log", 1800)
    s["job_wall_s"] = time.time() - start
    s["load_after"] = _load()
    if code != 0:
        raise RuntimeError(f"setting {s['name']} failed (exit {code}); "
                           f"see {out / 'runs' / (s['name'] + '.log')}")
    return run_dir


def summarise(run_dir: Path, warmup: int) -> dict[str, Any]:
    """Rates over the timed window of one job, from its metrics.jsonl and summary.json."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(rows) <= warmup:
        raise RuntimeError(f"{run_dir}: {len(rows)} steps recorded, the warm-up alone is {warmup}")
    first = rows[warmup - 1] if warmup else {"time": 0.0, "gen_totals": {}}
    window, last = rows[warmup:], rows[-1]
    dt = last["time"] - first["time"]
    gen = {k: last["gen_totals"].get(k, 0.0) - first["gen_totals"].get(k, 0.0)
           for k in (*GEN_TOTALS, "tokens")}
    gen_busy = sum(gen[k] for k in GEN_TOTALS)
    summary = json.loads((run_dir / "summary.json").read_text())
    if not gen_busy:  # steps shorter than the launcher's 1 s tick: whole-run generator totals
        gen = {k: sum(g.get(k, 0.0) for g in summary["generators"]) for k in (*GEN_TOTALS, "tokens")}
        gen_busy, dt_gen = sum(gen[k] for k in GEN_TOTALS), summary["wall_s"]
    else:
        dt_gen = dt
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
    policy_curve = [{"version": v, "samples": made[v][0], "time": made[v][1], "reward": s / n}
                    for v, (n, s) in sorted(earned.items())]
    return {
        "timed_steps": len(window),
        "window_s": dt,
        "samples_per_s": sum(r["samples"] for r in window) / dt,
        "trained_tokens_per_s": sum(r["tokens"] for r in window) / dt,
        "tokens_per_s": gen["tokens"] / dt_gen,  # generated response tokens
        "gen_idle": gen["idle_s"] / gen_busy if gen_busy else float("nan"),
        "learner_idle": sum(r["time_wait"] for r in window) / dt,
        "weight_sync_share": sum(r["weight_sync_share"] for r in window) / len(window),
        "step_s": dt / len(window),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "reward_final": sum(r["reward_mean"] for r in tail) / len(tail),
        "policy_curve": policy_curve,
        "accounting": {k: summary.get(k) for k in ("produced", "trained", "dropped_stale", "lost")},
    }


# -- report --------------------------------------------------------------------------------
def _best_async(runs: list[dict]) -> dict | None:
    cands = [r for r in runs if r["placement"] == "dedicated" and r["max_staleness"] > 0]
    return max(cands, key=lambda r: r["samples_per_s"]) if cands else None


def verdicts(runs: list[dict], bounds: dict) -> dict[str, Any]:
    """The issue's targets, computed from this run. "Same placement": the synchronous (k = 0)
    dedicated run with the same generator count as the best asynchronous one."""
    best = _best_async(runs)
    sync = [r for r in runs if r["placement"] == "dedicated" and r["max_staleness"] == 0]
    sync_same = next((r for r in sync if best and r["generators"] == best["generators"]), None)
    sync_best = max(sync, key=lambda r: r["samples_per_s"]) if sync else None
    colo = next((r for r in runs if r["placement"] == "colocated"), None)
    v: dict[str, Any] = {"best_async": best and best["name"]}
    if best and sync_same:
        v["speedup_vs_sync_same_placement"] = best["samples_per_s"] / sync_same["samples_per_s"]
    if best and sync_best:  # k = 0 with more generators uses the idle learner's core too
        v["speedup_vs_best_sync_dedicated"] = best["samples_per_s"] / sync_best["samples_per_s"]
        v["best_sync_dedicated"] = sync_best["name"]
    if best:
        v["fraction_of_bound"] = best["samples_per_s"] / bounds["min_samples_per_s"]
    if best and colo:
        v["speedup_vs_colocated"] = best["samples_per_s"] / colo["samples_per_s"]
    for g in sorted({r["generators"] for r in runs}):
        k0 = next((r for r in sync if r["generators"] == g), None)
        k2 = next((r for r in runs if r["placement"] == "dedicated" and r["max_staleness"] == 2
                   and r["generators"] == g), None)
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
    lines += ["| setting | placement | k | gens | samples/s | of bound | gen tok/s | gen idle | "
              "learner idle | sync share | staleness hist | reward end | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        frac = f"{r['fraction_of_bound']:.0%}" if r.get("fraction_of_bound") is not None else "-"
        hist = " ".join(f"{k}:{v}" for k, v in r["staleness_hist"].items())
        lines.append(f"| {r['name']} | {r['placement']} | {r['max_staleness']} | {r['generators']} | "
                     f"{r['samples_per_s']:.2f} | {frac} | {r['tokens_per_s']:.0f} | {r['gen_idle']:.0%} | "
                     f"{r['learner_idle']:.0%} | {r['weight_sync_share']:.1%} | {hist} | "
                     f"{r['reward_final']:.3f} | {r['load_before']}->{r['load_after']} |")
    lines += ["", "Allocation: " + "; ".join(f"{r['name']}: {r['allocation']}" for r in report["runs"]), ""]
    lines += ["Targets: " + ", ".join(f"{k} = {v:.2f}" if isinstance(v, float) else f"{k} = {v}"
                                      for k, v in report["verdicts"].items()), ""]
    path.write_text("\n".join(lines))


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
    axes[1][1].set_xlabel("wall time the policy was made, from the job's start (s)")
    for ax in axes[1]:
        ax.set_ylabel("mean reward of the policy's samples")
    axes[1][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    from actors.model_init import ensure_model
    from async_rlhf.config import load_config

    cfg = load_config(args.config, args.overrides)
    ensure_model(cfg.model.path, cfg.model.preset, seed=cfg.seed)
    steps = args.steps or cfg.learner.steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "async-rlhf " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("async-rlhf") else " ".join(sys.argv)
    start = time.time()
    before = measure_bounds(args, out, "before")
    runs = []
    for s in settings(args, cfg):
        print(f"setting {s['name']}: {s['allocation']} (load {_load()})", flush=True)
        run_dir = run_setting(args, s, out, steps)
        s.update(summarise(run_dir, args.warmup))
        runs.append(s)
        print(f"  {s['samples_per_s']:.2f} samples/s, gen idle {s['gen_idle']:.0%}, learner idle "
              f"{s['learner_idle']:.0%}, staleness {s['staleness_hist']}, reward {s['reward_final']:.3f}, "
              f"load {s['load_before']}->{s['load_after']}", flush=True)
    try:
        measured = [before, measure_bounds(args, out, "after")]
    except RuntimeError as e:  # the settings' results still count: report the first bounds
        print(f"bounds after the settings failed, keeping those before: {e}", flush=True)
        measured = [before]
    bounds = best_bounds(measured)
    for s in runs:
        if s["placement"] == "dedicated":
            s["fraction_of_bound"] = s["samples_per_s"] / bounds["min_samples_per_s"]
    report = {"command": command, "config": args.config, "overrides": args.overrides,
              "cpus": os.cpu_count(), "warmup": args.warmup, "timed_steps": steps,
              "batch_size": cfg.learner.batch_size, "wall_s": time.time() - start,
              "bounds": bounds, "runs": runs}
    report["verdicts"] = verdicts(runs, bounds)
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    write_markdown(report, out / "bench.md")
    plot(report, out / "bench.png")
    print((out / "bench.md").read_text())
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'} in {report['wall_s']:.0f} s")
    return 0
