"""`async-rlhf bench`: asynchronous vs synchronous training throughput, in one run.

Every setting is a whole `train` job (launcher.Job, in its own process, out dir and job name) on
the same model, task and seed for the same number of learner steps; the first `--warmup` steps
are not counted. Rates come from the job's metrics.jsonl: the timed window runs from the end of
step W to the end of the last step.

    bounds     generation alone: one generator (the real loop: engine, scoring, Redis put)
               with the learner absent, generator.threads threads; the engine alone: the same
               engine kept at generator.max_inflight sequences by continuous batching, no
               scoring, no queue (what the generator's tokens/s is measured against);
               training alone: the real Learner on DeepSpeed with learner.threads threads, fed
               those trajectories from a Redis stream (cycled, each batch stamped with the
               version that trains it). Each in a fresh process, one after the other; the rest
               of the machine idle. Measured before and after the settings; each stage's bound
               is the faster of its two measurements (neighbours on a shared machine only slow
               a stage down).
    dedicated  a job with max_staleness=k and g generators: the learner rank and each
               generator are separate processes (Ray actors) on learner.threads and
               generator.threads threads: each stage its own core(s). k = 0 is synchronous.
    modes      with --modes, each dedicated setting runs once per generator mode: inflight
               (groups stream, weights load between engine steps), between_groups (groups
               stream, a new version waits for an empty engine), lockstep (the old generator:
               whole batches of max_inflight sequences, updates between batches).
    colocated  the baseline, a standard synchronous colocated trainer (TRL's, OpenRLHF's
               colocated mode): a k = 0 job whose generator makes the whole learner batch in one
               engine call (generator.schedule=lockstep, max_inflight = learner.batch_size) on
               every core, then the learner trains on it on every core (threads = cpu count).
               The phases take turns: one runs with all cores while the other waits (blocked on
               the gate or on the stream, not spinning), plus the weight broadcast between them.
    auto       with --auto K,..., a job with max_staleness=K and placement: auto, placed by the
               stage costs the bounds measured before the settings (async_rlhf/launch/placement.py).

Reported per setting: trained samples/s and response tokens/s, generated tokens/s, generator
idle fraction (of its engine loop's time, idle / (idle + engine steps + weight loads), over the
window; scoring and puts overlap it in their own thread), mean sequences in its engine and
in-flight weight updates (whole job), mean staleness (per sample: the oldest token's; and per
token), learner
idle fraction (time waiting for a batch / window), weight-sync share of the step, staleness
histogram, reward at the end (batch mean over the last quarter of steps), the policy curve (the
mean reward of the samples each policy version generated, against the samples trained to make
that version and the time it was made) and the fraction of min(bound_gen, bound_train) reached;
and seconds from the command's start (the train process's) to the first learner step, to policy
rewards 0.5, 0.8 and 0.9 on the policy curve (smoothed: report.smoothed) and to the
command's exit, with the job's start-up breakdown and shutdown time (its summary.json).
"The baseline" is the strongest synchronous setting (the k = 0 run with the most samples/s);
the verdicts are ratios against it. Reward per sample compares policy curves over the versions
both runs reached (the best asynchronous run and the baseline; k = 2 and k = 0 per generator
count).
Writes OUT/bench.json, OUT/bench.md, OUT/bench.png; each job keeps its own directory under
OUT/runs/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from async_rlhf.launch.bench.report import plot, save, summarise, verdicts, write_markdown
from async_rlhf.launch.cli import int_list
from async_rlhf.procs import run_child

# generator.schedule and generator.weight_updates of each --modes name
MODES = {"inflight": ("stream", "inflight"), "between_groups": ("stream", "between_groups"),
         "lockstep": ("lockstep", "between_groups")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config of the job to benchmark")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--staleness", default="0,1,2,4", help="max_staleness values (0 = synchronous)")
    parser.add_argument("--generators", default="1,2", help="generator counts")
    parser.add_argument("--steps", type=int, help="timed learner steps per setting (default: learner.steps)")
    parser.add_argument("--warmup", type=int, default=2, help="learner steps per setting not timed")
    parser.add_argument("--bound-steps", type=int, default=4, help="timed learner steps of the training bound")
    parser.add_argument("--no-colocated", action="store_true",
                        help="skip the colocated synchronous run (the baseline when it runs)")
    parser.add_argument("--auto", default="", help="max_staleness values to run with placement: auto "
                        "as well, placed by the stage bounds measured before the settings (e.g. 1,2)")
    parser.add_argument("--modes", default="", help="generator modes to compare, a comma list of "
                        f"{', '.join(MODES)} (default: the config's)")
    parser.add_argument("--worker", choices=["gen", "engine", "train"], help=argparse.SUPPRESS)  # internal
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)  # internal: the bounds' stream
    parser.add_argument("overrides", nargs="*", default=[], help="key=value config overrides")


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


# -- stage bounds (each in its own process) ------------------------------------------------
class _OpenGate:
    """AdmissionGate that always admits: generation with nobody to wait for."""

    def try_admit(self, n: int) -> bool:
        return True

    def finish(self, n_admitted: int, n_accepted: int) -> None:
        pass


def _bound_gen(cfg, redis_url: str, groups: int) -> dict[str, Any]:
    """The generator loop alone into stream bound-gen: warm up for an engine's worth of groups,
    then time `groups` more (the engine never drains: the loop runs on, stopped after)."""
    import threading

    from actors.generator import make_generator
    from buffer.redis_stream import RedisExperienceQueue

    queue = RedisExperienceQueue.from_config(cfg.queue, redis_url, consumer="bound-gen")
    gen = make_generator(cfg, queue, _OpenGate())
    stop = threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop,), daemon=True)
    runner.start()

    def after(target: int) -> tuple[dict[str, Any], float]:
        while (stats := gen.stats())["groups"] < target and runner.is_alive():
            time.sleep(0.02)
        return stats, time.perf_counter()

    before, start = after(cfg.generator.max_inflight // cfg.generator.group_size)
    end, stop_time = after(before["groups"] + groups)
    stop.set()
    runner.join()
    if end["groups"] < before["groups"] + groups:
        raise RuntimeError("generation bound: the generator loop ended early (see the log)")
    wall = stop_time - start
    samples, tokens = end["produced"] - before["produced"], end["tokens"] - before["tokens"]
    return {"samples_per_s": samples / wall, "tokens_per_s": tokens / wall, "wall_s": wall,
            "samples": samples, "threads": cfg.generator.threads, "mean_inflight": end["mean_inflight"],
            "generate_share": (end["generate_s"] - before["generate_s"]) / wall}


def _bound_engine(cfg, groups: int) -> dict[str, Any]:
    """The engine alone at generator.max_inflight sequences, on the config's prompts."""
    from transformers import AutoTokenizer

    from async_rlhf.launch.bench.gen import continuous_rate
    from actors.engines import make_engine
    from actors.prompts import make_prompt_stream

    g = cfg.generator
    prompts = make_prompt_stream(cfg.data, AutoTokenizer.from_pretrained(cfg.model.path), seed=cfg.seed)
    engine = make_engine(g, cfg.model.path, seed=cfg.seed)
    batch = prompts.take(groups)
    continuous_rate(engine, batch, g.group_size, g.max_inflight, g.max_inflight // g.group_size)  # warm-up
    return {**continuous_rate(engine, batch, g.group_size, g.max_inflight, groups), "threads": g.threads}


def _bound_train(cfg, redis_url: str, warmup: int, steps: int) -> dict[str, Any]:
    """The learner alone on the bound-gen groups, replayed through stream bound-train."""
    import dataclasses

    import torch

    from buffer.redis_stream import RedisExperienceQueue
    from buffer.replay import StalenessReplay
    from async_rlhf.launch.bench.learner import NullPublisher
    from learners.backends import make_backend
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
    backend = make_backend(cfg.learner, cfg.model.path, dtype=cfg.model.dtype,
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
    # two learner batches or four engines' worth of groups, whichever is more
    groups = max(2 * cfg.learner.batch_size, 4 * cfg.generator.max_inflight) // cfg.generator.group_size
    if args.worker == "gen":
        result = _bound_gen(cfg, args.redis_url, groups)
    elif args.worker == "engine":
        result = _bound_engine(cfg, groups)
    else:
        result = _bound_train(cfg, args.redis_url, args.warmup, args.bound_steps)
    print("BENCH-RESULT " + json.dumps(result))
    return 0


def measure_bounds(args: argparse.Namespace, out: Path, when: str) -> dict[str, Any]:
    """Each stage alone, in a fresh process, into OUT/bounds/WHEN/."""
    from buffer.redis_server import EmbeddedRedis

    base = [sys.executable, "-m", "async_rlhf.launch.cli", "bench", "--config", args.config, "--out", str(out),
            "--warmup", str(args.warmup), "--bound-steps", str(args.bound_steps), *args.overrides]
    bounds: dict[str, Any] = {}
    where = out / "bounds" / when
    where.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis(where / "redis") as redis:
        for stage in ("gen", "engine", "train"):
            load = _load()
            log_path = where / f"{stage}.log"
            code = run_child([*base, "--worker", stage, "--redis-url", redis.url], log_path, 900)
            lines = [l for l in log_path.read_text().splitlines() if l.startswith("BENCH-RESULT ")]
            if code != 0 or not lines:
                raise RuntimeError(f"{stage} bound failed (exit {code}); see {log_path}")
            result = json.loads(lines[-1][len("BENCH-RESULT "):])
            bounds[stage] = {**result, "load_before": load, "when": when}
            print(f"bound {stage} ({when} the settings): {bounds[stage]['samples_per_s']:.2f} samples/s, "
                  f"{bounds[stage]['tokens_per_s']:.0f} tokens/s ({bounds[stage]['threads']} thread(s), "
                  f"load {load})", flush=True)
    return bounds


def best_bounds(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Each stage's faster measurement: on a shared machine a neighbour only ever slows a stage
    down, so the faster one is nearer the stage's real limit (and the stricter bound)."""
    bounds: dict[str, Any] = {stage: max((m[stage] for m in measured), key=lambda b: b["samples_per_s"])
                              for stage in ("gen", "engine", "train")}
    bounds["min_samples_per_s"] = min(bounds["gen"]["samples_per_s"], bounds["train"]["samples_per_s"])
    # both stages' work packed on every core (each stage's core-seconds per sample from its bound)
    bounds["packed_samples_per_s"] = (os.cpu_count() or 1) / sum(
        bounds[stage]["threads"] / bounds[stage]["samples_per_s"] for stage in ("gen", "train"))
    # the generator's tokens/s against its engine's alone at the same sequences in flight
    bounds["gen_tokens_of_engine"] = bounds["gen"]["tokens_per_s"] / bounds["engine"]["tokens_per_s"]
    bounds["measurements"] = measured
    return bounds


# -- settings: whole jobs ------------------------------------------------------------------
def settings(args: argparse.Namespace, cfg, bounds: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The jobs to run, each with the config overrides that make it. `bounds`: the stage bounds
    measured so far, the costs the auto settings are placed by (else the config's stage_costs)."""
    cpus = os.cpu_count() or 1
    out = []
    if not args.no_colocated:  # the baseline: what a standard synchronous colocated trainer does
        out.append({"name": "colocated-k0-g1", "placement": "colocated", "max_staleness": 0,
                    "generators": 1, "generator_threads": cpus, "learner_threads": cpus, "mode": "",
                    "overrides": ["generator.schedule=lockstep", "generator.weight_updates=between_groups",
                                  f"generator.max_inflight={cfg.learner.batch_size}"]})
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes lists {unknown[0]!r}: choose from {', '.join(MODES)}")
    for mode in modes or [""]:
        for g in int_list(args.generators, "generators"):
            for k in int_list(args.staleness, "staleness"):
                out.append({"name": f"dedicated-k{k}-g{g}" + (f"-{mode}" if mode else ""),
                            "placement": "dedicated", "max_staleness": k, "generators": g,
                            "generator_threads": cfg.generator.threads,
                            "learner_threads": cfg.learner.threads, "mode": mode,
                            "overrides": [f"generator.schedule={MODES[mode][0]}",
                                          f"generator.weight_updates={MODES[mode][1]}"] if mode else []})
    for s in out:
        s["overrides"] = [f"max_staleness={s['max_staleness']}", f"generator.count={s['generators']}",
                          f"generator.threads={s['generator_threads']}",
                          f"learner.threads={s['learner_threads']}", *s["overrides"]]
        s["allocation"] = (f"{s['generators']} generator process(es) x {s['generator_threads']} thread(s) "
                           f"+ 1 learner process x {s['learner_threads']} thread(s) on {cpus} cores")
    costs = ([f"stage_costs.generator_s={bounds['gen']['threads'] / bounds['gen']['samples_per_s']}",
              f"stage_costs.learner_s={bounds['train']['threads'] / bounds['train']['samples_per_s']}"]
             if bounds else [])
    for k in int_list(args.auto, "auto") if args.auto else []:
        out.append({"name": f"auto-k{k}", "placement": "auto", "max_staleness": k, "mode": "",
                    "overrides": [f"max_staleness={k}", "placement=auto", *costs],
                    "allocation": "placement: auto, from the stage bounds measured before"
                                  if bounds else "placement: auto, from the config's stage_costs"})
    return out


def run_setting(args: argparse.Namespace, s: dict[str, Any], out: Path, steps: int) -> Path:
    run_dir = out / "runs" / s["name"]
    argv = [sys.executable, "-m", "async_rlhf.launch.cli", "train", "--config", args.config, *args.overrides,
            f"job=bench-{s['name']}", f"out={run_dir}", *s["overrides"],
            f"learner.steps={args.warmup + steps}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json"):  # a rerun into the same OUT starts afresh
        (run_dir / stale).unlink(missing_ok=True)
    s["load_before"] = _load()
    start = time.time()
    code = run_child(argv, out / "runs" / f"{s['name']}.log", 1800)
    s["job_wall_s"] = time.time() - start  # from the command to its exit
    s["load_after"] = _load()
    if code != 0:
        raise RuntimeError(f"setting {s['name']} failed (exit {code}); "
                           f"see {out / 'runs' / (s['name'] + '.log')}")
    if s["placement"] == "auto":  # what the job chose
        import yaml

        placed = yaml.safe_load((run_dir / "config.yaml").read_text())
        s.update(generators=placed["generator"]["count"], generator_threads=placed["generator"]["threads"],
                 learner_threads=placed["learner"]["threads"], learner_ranks=placed["learner"]["ranks"])
    return run_dir


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
    for s in settings(args, cfg, best_bounds([before])):
        print(f"setting {s['name']}: {s['allocation']} (load {_load()})", flush=True)
        run_dir = run_setting(args, s, out, steps)
        s.update(summarise(run_dir, args.warmup))
        if s["placement"] == "auto":
            s["allocation"] += f" ({s['placement_chosen']})"
        runs.append(s)
        print(f"  {s['samples_per_s']:.2f} samples/s, gen idle {s['gen_idle']:.0%} (mean "
              f"{s['gen_mean_inflight']:.1f} in flight, {s['gen_inflight_updates']} in-flight updates), "
              f"learner idle {s['learner_idle']:.0%}, staleness {s['staleness_hist']} (mean "
              f"{s['staleness_mean']:.2f}, per token {s['staleness_token_mean']:.2f}), reward "
              f"{s['reward_final']:.3f}, load {s['load_before']}->{s['load_after']}; from the command: "
              f"first step {s['first_step_s']:.1f} s, reward 0.9 {s['reward_s']['0.9']} s, end "
              f"{s['job_wall_s']:.1f} s, shutdown {s['shutdown_s']} s", flush=True)
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
    save(report, out, "bench", write_markdown, plot)
    return 0
