"""`async-rlhf bench`'s stage bounds: each stage alone, in a fresh process, the rest of the
machine idle (see jobs.py for how the settings are read against them).

    gen     one generator (the real loop: engine, scoring, Redis put) with the learner absent,
            generator.threads threads
    engine  the same engine kept at generator.max_inflight sequences by continuous batching, no
            scoring, no queue (what the generator's tokens/s is measured against)
    train   the real Learner with learner.threads threads, fed the gen stage's trajectories from
            a Redis stream (cycled, each batch stamped with the version that trains it)
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_rlhf.hub import resolve_model
from async_rlhf.launch.bench.harness import in_child, warm_then_time
from async_rlhf.messages import GeneratorStats, StepTimes

STAGES = ("gen", "engine", "train")


@dataclass(frozen=True)
class StageBound:
    stage: str
    samples_per_s: float
    tokens_per_s: float
    wall_s: float
    threads: int
    mean_inflight: float | None = None  # gen and engine: mean sequences in the engine
    detail: dict[str, Any] = field(default_factory=dict)  # what the stage alone tells
    when: str = ""  # before or after the settings
    load_before: str = ""


@dataclass(frozen=True)
class Bounds:
    """Each stage's faster measurement: on a shared machine a neighbour only ever slows a stage
    down, so the faster one is nearer the stage's real limit (and the stricter bound)."""

    gen: StageBound
    engine: StageBound
    train: StageBound
    min_samples_per_s: float  # the slower of generation and training alone
    packed_samples_per_s: float  # both stages' work packed on every core
    measurements: list[dict[str, StageBound]]

    @classmethod
    def best(cls, measured: list[dict[str, StageBound]]) -> Bounds:
        gen, engine, train = (max((m[s] for m in measured), key=lambda b: b.samples_per_s) for s in STAGES)
        # each stage's core-seconds per sample, from its bound
        per_sample = gen.threads / gen.samples_per_s + train.threads / train.samples_per_s
        return cls(gen, engine, train, min(gen.samples_per_s, train.samples_per_s),
                   (os.cpu_count() or 1) / per_sample, measured)


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def measure(cfg, where: Path, when: str, warmup: int, steps: int) -> dict[str, StageBound]:
    """Each stage alone, one after the other, each in a fresh process logging into WHERE/."""
    from buffer.redis_server import EmbeddedRedis

    # two learner batches or four engines' worth of groups, whichever is more
    groups = max(2 * cfg.learner.batch_size, 4 * cfg.generator.max_inflight) // cfg.generator.group_size
    where.mkdir(parents=True, exist_ok=True)
    bounds = {}
    with EmbeddedRedis(where / "redis") as redis:
        calls = {"gen": (bound_gen, cfg, redis.url, groups), "engine": (bound_engine, cfg, groups),
                 "train": (bound_train, cfg, redis.url, warmup, steps)}
        for stage, (fn, *args) in calls.items():
            load = load_average()
            b = in_child(fn, *args, log=where / f"{stage}.log")
            bounds[stage] = b = StageBound(**{**vars(b), "when": when, "load_before": load})
            print(f"bound {stage} ({when} the settings): {b.samples_per_s:.2f} samples/s, "
                  f"{b.tokens_per_s:.0f} tokens/s ({b.threads} thread(s), load {load})", flush=True)
    return bounds


class _OpenGate:
    """AdmissionGate that always admits: generation with nobody to wait for."""

    def try_admit(self, n: int) -> bool:
        return True

    def finish(self, n_admitted: int, n_accepted: int) -> None:
        pass


def bound_gen(cfg, redis_url: str, groups: int) -> StageBound:
    """The generator loop alone into the stream: warm up for an engine's worth of groups, then
    time `groups` more (the engine never drains: the loop runs on, stopped after)."""
    from actors.generator import make_generator
    from buffer.redis_stream import RedisExperienceQueue

    queue = RedisExperienceQueue.from_config(cfg.queue, redis_url, consumer="bound-gen")
    gen = make_generator(cfg, queue, _OpenGate())
    stop = threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop,), daemon=True)
    runner.start()

    def after(target: int) -> tuple[GeneratorStats, float]:
        while (stats := gen.stats()).groups < target and runner.is_alive():
            time.sleep(0.02)
        return stats, time.perf_counter()

    before, start = after(cfg.generator.max_inflight // cfg.generator.group_size)
    end, stop_time = after(before.groups + groups)
    stop.set()
    runner.join()
    if end.groups < before.groups + groups:
        raise RuntimeError("generation bound: the generator loop ended early (see the log)")
    wall = stop_time - start
    samples, tokens = end.produced - before.produced, end.tokens - before.tokens
    return StageBound("gen", samples / wall, tokens / wall, wall, cfg.generator.threads, end.mean_inflight,
                      {"samples": samples, "generate_share": (end.generate_s - before.generate_s) / wall})


def bound_engine(cfg, groups: int) -> StageBound:
    """The engine alone at generator.max_inflight sequences, on the config's prompts."""
    from transformers import AutoTokenizer

    from actors.engines import make_engine
    from actors.prompts import make_prompt_stream
    from async_rlhf.launch.bench.gen import continuous_rate

    g = cfg.generator
    path = resolve_model(cfg.model.path)
    prompts = make_prompt_stream(cfg.data, AutoTokenizer.from_pretrained(path), seed=cfg.seed)
    engine = make_engine(g, path, seed=cfg.seed, model_dtype=cfg.model.dtype)
    batch = prompts.take(groups)
    continuous_rate(engine, batch, g.group_size, g.max_inflight, g.max_inflight // g.group_size)  # warm-up
    r = continuous_rate(engine, batch, g.group_size, g.max_inflight, groups)
    return StageBound("engine", r.pop("samples_per_s"), r.pop("tokens_per_s"), r.pop("wall_s"), g.threads,
                      r.pop("mean_inflight"), r)


def bound_train(cfg, redis_url: str, warmup: int, steps: int) -> StageBound:
    """The learner alone on the gen stage's groups, replayed through stream bound-train."""
    import dataclasses

    import torch

    from async_rlhf.launch.bench.learner import NullPublisher
    from buffer.redis_stream import RedisExperienceQueue
    from buffer.replay import StalenessReplay
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
        cycled = [groups[(v * batch + i) % len(groups)] for i in range(batch)]
        queue.put([g.with_version(v, f"{g.group_id}@v{v}") for g in cycled])
    backend = make_backend(cfg.learner, cfg.model.path, dtype=cfg.model.dtype,
                           temperature=cfg.generator.temperature, seed=cfg.seed)
    learner = Learner(cfg.learner, backend, max_staleness=total, group_size=cfg.generator.group_size,
                      queue=queue, replay=StalenessReplay(max_reuse=1, max_staleness=total),
                      publisher=NullPublisher())
    timed = warm_then_time(learner.step, warmup=warmup, repeats=steps)
    wall, history = sum(t for t, _ in timed), [m for _, m in timed]
    samples = sum(m.samples for m in history)
    return StageBound("train", samples / wall, sum(m.tokens for m in history) / wall, wall,
                      cfg.learner.threads, detail={
                          "samples": samples, "step_s": wall / steps,
                          "share": {k: v / wall for k, v in
                                    dataclasses.asdict(StepTimes.total(m.times for m in history)).items()}})
