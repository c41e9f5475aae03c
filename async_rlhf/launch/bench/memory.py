"""`async-rlhf bench-memory`: a job's peak memory at real sizes, beside placement's estimate.

For each model shape (the presets tiny and small, and Qwen2.5-0.5B's exact configuration: 494M
parameters, a 151,936-entry vocabulary, tied embeddings, 24 layers, GQA 14/2, built offline
with random weights and a character tokenizer filled out to that vocabulary), it runs `train`
on configs/demo.yaml at the defaults (placement: auto) for a few steps in a child process, and
samples the proportional set size (PSS: shared pages split between their processes, as the
node's memory counts them) of every process the job starts, by part: learner ranks,
generators, the rest (Ray, Redis, the launcher). It reports each part's peak and the whole
job's beside the estimate placement printed (launch/memory.py), the start-up, seconds per
step, the behaviour weight of the first steps and the accounting (`lost` must be 0).

`--learner` measures the learner alone on one shape instead (bench-learner's feed, no Redis or
generators): its peak memory and samples/s at ZeRO-0, with gradient checkpointing, and with
ZeRO-1 and ZeRO-3 optimizer (and parameter) offload, each in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from async_rlhf.launch.bench.harness import in_child, save
from async_rlhf.procs import run_child

GIB = 1 << 30
# Qwen2.5-0.5B's configuration (its config.json), built here with random weights
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=32_768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
SHAPES = ("tiny", "small", "qwen2.5-0.5b")
LEARNER_SETTINGS = {  # name -> learner config overrides
    "ZeRO-0": {},
    "ZeRO-0 + gradient checkpointing": {"gradient_checkpointing": True},
    "ZeRO-1 + optimizer offload": {"zero_stage": 1, "offload_optimizer": True},
    "ZeRO-3 + optimizer and parameter offload": {"zero_stage": 3, "offload_optimizer": True, "offload_params": True},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--steps", type=int, default=4, help="learner steps each job trains")
    parser.add_argument("--learner", action="store_true",
                        help="the learner alone, by memory setting (on the first of --shapes)")
    parser.add_argument("--models", default="runs/models", help="where the models are built (kept)")
    parser.add_argument("--out", default="runs/bench/memory.json")
    parser.add_argument("overrides", nargs="*", default=[], help="key=value config overrides for every job")


def build_shape(shape: str, root: Path) -> Path:
    """The model directory of `shape`, built once (random init, offline)."""
    out = root / shape
    if (out / "config.json").is_file():
        return out
    from actors.model_init import init_model

    if shape != "qwen2.5-0.5b":
        return init_model(out, shape)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from actors.model_init import build_tokenizer

    tok = build_tokenizer()
    fill = QWEN25_05B["vocab_size"] - len(tok)
    # sampled like any token, never encoded; named without the letter the `count` task rewards
    tok.add_tokens([f"<unused_{i}>" for i in range(fill)])
    config = Qwen2Config(**QWEN25_05B, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def part_of(proc) -> str:
    """The job part a process belongs to: by its title (Ray workers: ray::Class.method) or its
    nearest titled ancestor's (a generator's reward workers, an engine core process)."""
    for p in (proc, *proc.parents()):
        title = " ".join(p.cmdline()[:1])
        for name, part in (("Learner", "learner"), ("Generator", "generator"), ("Eval", "evaluator")):
            if name in title:
                return part
    return "rest"


@dataclass
class PeakMemory:
    """Samples the PSS of this process's descendants every `every_s` in a thread: the peak of
    their sum, each part's peak sum, and the largest single learner rank's peak."""

    every_s: float = 0.5
    total: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    learner_rank: float = 0.0

    def __enter__(self) -> PeakMemory:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.every_s):
            by_part: dict[str, float] = {}
            for proc in me.children(recursive=True):
                try:
                    pss = proc.memory_full_info().pss
                    part = part_of(proc)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                by_part[part] = by_part.get(part, 0.0) + pss
                if part == "learner":
                    self.learner_rank = max(self.learner_rank, pss)
            self.total = max(self.total, sum(by_part.values()))
            for part, used in by_part.items():
                self.parts[part] = max(self.parts.get(part, 0.0), used)


def _estimate_line(log: str) -> dict[str, float]:
    """The estimate placement printed: total and each part, GiB."""
    m = re.search(r"memory: ([\d.]+) GiB = learner (\d+) x ([\d.]+) \+ generators (\d+) x ([\d.]+)"
                  r"(?: \+ evaluator ([\d.]+))? \+ Ray, Redis and the launcher ([\d.]+)", log)
    if not m:
        return {}
    total, ranks, rank, gens, gen, ev, rest = m.groups()
    return {"total": float(total), "learner": int(ranks) * float(rank), "learner_rank": float(rank),
            "generator": int(gens) * float(gen), "evaluator": float(ev or 0), "rest": float(rest)}


def bench_job(shape: str, model: Path, steps: int, overrides: list[str], out: Path) -> dict:
    """`train` on configs/demo.yaml with `model`, its peak memory beside the estimate."""
    argv = [sys.executable, "-m", "async_rlhf.launch.cli", "train", "--config", "configs/demo.yaml",
            f"model.path={model}", "model.preset=null", f"learner.steps={steps}", f"out={out}",
            f"job=bench-memory-{shape}", *overrides]
    log = out.parent / f"{out.name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with PeakMemory() as peak:
        code = run_child(argv, log, timeout_s=3600)
    text = log.read_text()
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    seconds = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])] if rows and "time" in rows[0] else []
    measured = {"total": peak.total / GIB, "learner_rank": peak.learner_rank / GIB,
                **{k: v / GIB for k, v in peak.parts.items()}}
    estimate = _estimate_line(text)
    return {"shape": shape, "exit": code, "estimate_gib": estimate,
            "measured_gib": {k: round(v, 2) for k, v in measured.items()},
            "estimate_over_measured": round(estimate["total"] / measured["total"], 2) if estimate else None,
            "startup": summary.get("startup", {}), "placement": summary.get("placement", ""),
            "accounting": {k: summary.get(k) for k in ("produced", "trained", "lost")}, "error": summary.get("error", ""),
            "seconds_per_step": round(sum(seconds) / len(seconds), 1) if seconds else None,
            "bw_mean_first_steps": [round(r.get("bw_mean", float("nan")), 3) for r in rows[:3]]}


def learner_steps(model: str, overrides: dict, steps: int) -> dict:
    """bench-learner's step on `model` with learner `overrides` (run in a child process)."""
    import torch

    from async_rlhf.launch.bench.learner import add_arguments, bench_one

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", model, "--steps", str(steps), "--batch-size", "8", "--micro-batch", "4",
                              "--response-len", "64"])
    torch.set_num_threads(args.threads)
    r = bench_one(args, overrides.get("zero_stage", 0), "auto", overrides)
    return {"samples_per_s": r.samples_per_s, "setting": r.setting}


def bench_learner(model: Path, steps: int, out: Path) -> list[dict]:
    results = []
    for name, overrides in LEARNER_SETTINGS.items():
        with PeakMemory(every_s=0.2) as peak:
            r = in_child(learner_steps, str(model), overrides, steps, log=out.parent / f"learner-{len(results)}.log")
        results.append({"setting": name, "peak_gib": round(peak.total / GIB, 2), **r})
        print(f"{name}: peak {peak.total / GIB:.2f} GiB, {r['samples_per_s']} samples/s", flush=True)
    return results


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    root = Path(args.models)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.learner:
        model = in_child(build_shape, args.shapes[0], root, log=out.parent / f"build-{args.shapes[0]}.log")
        results = bench_learner(model, args.steps, out)
        save({"shape": args.shapes[0], "learner": results}, out)
        return 0
    results = []
    for shape in args.shapes:  # built in a child: the model's memory is not this process's
        model = in_child(build_shape, shape, root, log=out.parent / f"build-{shape}.log")
        t = time.monotonic()
        r = bench_job(shape, model, args.steps, args.overrides, out.parent / f"job-{shape}")
        results.append(r)
        est, got = r["estimate_gib"], r["measured_gib"]
        print(f"{shape}: exit {r['exit']} in {time.monotonic() - t:.0f} s; peak {got['total']:.2f} GiB "
              f"(learner {got.get('learner', 0):.2f}, generators {got.get('generator', 0):.2f}, rest "
              f"{got.get('rest', 0):.2f}) against an estimate of {est.get('total')} GiB "
              f"({est.get('learner')}, {est.get('generator')}, {est.get('rest')}); "
              f"{r['seconds_per_step']} s a step; start-up {r['startup']}; bw {r['bw_mean_first_steps']}",
              flush=True)
    save({"jobs": results}, out)
    return 0
