"""`async-rlhf bench-learner`: learner throughput and where its time goes.

Builds a preset-shaped random-init Llama in-process (no download), feeds the real Learner and
DeepSpeed backend pre-generated random groups of trajectories from memory (no Redis: this measures learner
compute; `bench-queue` measures the stream), warms up, then times steps: trained samples/s,
response tokens/s, and the share of each step spent waiting, recomputing pi_prox, in the train
forward, backward, optimizer step and the full-weight gather for the weight sync. Several ZeRO
stages can be compared in one run. Writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from async_rlhf.synthetic import PRESETS

PHASES = ("wait", "recompute", "forward", "backward", "step", "weight_gather", "publish")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[0], help="one or more stages to compare")
    parser.add_argument("--batch-size", type=int, default=16, help="trajectories per step")
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per group (GRPO's n)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default="runs/bench/learner.json")


class NullPublisher:
    """Consumes the gathered weights like a broadcast would, without sending them."""

    def publish(self, named_tensors, version):
        for _ in named_tensors:
            pass


def bench_one(args: argparse.Namespace, zero_stage: int) -> dict:
    from async_rlhf.config import LearnerConfig
    from async_rlhf.synthetic import CHAR_VOCAB_SIZE, build_model, random_groups
    from async_rlhf.launch.bench.feed import OnceReplay, PreloadedQueue
    from learners.deepspeed_backend import DeepSpeedBackend
    from learners.learner import Learner

    cfg = LearnerConfig(batch_size=args.batch_size, micro_batch=args.micro_batch, zero_stage=zero_stage,
                        steps=args.warmup + args.steps)
    model = build_model(args.preset)
    params = sum(p.numel() for p in model.parameters())
    backend = DeepSpeedBackend(cfg, model, dtype=args.dtype)
    queue = PreloadedQueue()
    learner = Learner(cfg, backend, max_staleness=0, group_size=args.group_size, queue=queue,
                      replay=OnceReplay(), publisher=NullPublisher())
    per_batch = cfg.batch_size // args.group_size
    n = per_batch * cfg.steps  # groups
    groups = random_groups(n, vocab=CHAR_VOCAB_SIZE, prompt_len=args.prompt_len,
                           response_len=args.response_len, group_size=args.group_size)
    for i in range(cfg.steps):  # stamp each batch with the version that will train it
        queue.put([g.with_version(i) for g in groups[i * per_batch:(i + 1) * per_batch]])
    learner.train(args.warmup)
    t0 = time.perf_counter()
    history = learner.train(args.steps)
    wall = time.perf_counter() - t0
    if dict(queue.acked) != {"trained": n}:  # anything dropped would make the numbers lie
        raise RuntimeError(f"bench-learner expected {n} groups trained, got {dict(queue.acked)}")
    totals = {p: sum(m[f"time_{p}"] for m in history) for p in PHASES}
    samples = sum(m["samples"] for m in history)
    tokens = sum(m["tokens"] for m in history)
    return {
        "zero_stage": zero_stage,
        "params_m": round(params / 1e6, 2),
        "steps": args.steps,
        "wall_s": round(wall, 3),
        "samples_per_s": round(samples / wall, 3),
        "response_tokens_per_s": round(tokens / wall, 1),
        "all_tokens_per_s": round(samples * (args.prompt_len + args.response_len) / wall, 1),
        "share": {p: round(totals[p] / wall, 3) for p in PHASES},
        "seconds": {p: round(totals[p], 3) for p in PHASES},
    }


def _plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 1.2 + 0.5 * len(results)))
    labels = [f"ZeRO-{r['zero_stage']}" for r in results]
    left = [0.0] * len(results)
    for p in PHASES:
        widths = [r["share"][p] for r in results]
        ax.barh(labels, widths, left=left, label=p)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("share of step time")
    ax.legend(fontsize=7, ncol=len(PHASES), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path)


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    results = [bench_one(args, stage) for stage in args.zero_stage]
    setup = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setup": setup, "results": results}, indent=2))
    _plot(results, out.with_suffix(".png"))
    for r in results:
        shares = "  ".join(f"{p} {100 * r['share'][p]:.0f}%" for p in PHASES)
        print(f"ZeRO-{r['zero_stage']} {r['params_m']}M params: {r['samples_per_s']} samples/s, "
              f"{r['response_tokens_per_s']} response tok/s, {r['all_tokens_per_s']} tok/s | {shares}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
