"""`async-rlhf bench-gen`: generation throughput, vLLM engine vs the transformers engine.

Both engines get the same prompts (built-in task prompts, tokenized with the model's tokenizer),
sample with the same settings, and stop at EOS or max_new_tokens, so response lengths vary as in
real use. Each engine runs in its own fresh subprocess (the in-process vLLM engine pins this
process's threads and memory policy), is warmed up once, then timed `--repeats` times. Tokens are
response tokens actually produced (EOS included, padding not). Reported: tokens/s, tokens/s per
thread, mean response length, share of responses that ended at EOS, and the per-thread speedup
of vLLM over transformers at its best thread count (`--hf-threads 1,2` runs both: on a busy
machine 2 OpenMP threads can be several times slower than 1, since they wait on each other);
written as JSON (and a PNG bar chart when matplotlib is present).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=["tiny", "small"], default="small")
    parser.add_argument("--model", default=None,
                        help="model directory (default runs/models/<preset>; built if absent)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--vllm-threads", type=int, default=1)
    parser.add_argument("--hf-threads", default="2", help="threads for transformers; a comma list runs each")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", default="vllm,hf", help="comma-separated subset of vllm,hf")
    parser.add_argument("--out", default="runs/bench/gen.json")
    parser.add_argument("--task", default="copy", help="built-in task whose prompts are used")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one engine


def _measure(args: argparse.Namespace) -> dict:
    """Runs inside the per-engine subprocess."""
    import torch
    from transformers import AutoTokenizer

    from actors.engines import make_engine
    from actors.tasks import examples
    from async_rlhf.config import GeneratorConfig
    from async_rlhf.types import Prompt

    threads = args.vllm_threads if args.worker == "vllm" else int(args.hf_threads)
    cfg = GeneratorConfig(engine=args.worker, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, threads=threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [Prompt(f"b{i}", tuple(tok(t)["input_ids"]), t, a)
               for i, (t, a) in enumerate(examples(args.task, 0, args.prompts))]
    start = time.perf_counter()
    engine = make_engine(cfg, args.model, seed=0)
    startup_s = time.perf_counter() - start
    engine.generate(prompts, 1)  # warm-up
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        samples = [g[0] for g in engine.generate(prompts, 1)]
        seconds = time.perf_counter() - start
        tokens = sum(len(s.response_ids) for s in samples)
        runs.append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                     "mean_length": tokens / len(samples),
                     "ended_at_eos": sum(s.finished for s in samples) / len(samples)})
    tps = sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)
    return {"engine": args.worker, "threads": threads, "torch_threads_seen": torch.get_num_threads(),
            "startup_s": startup_s, "tokens_per_s": tps, "tokens_per_s_per_thread": tps / threads,
            "weight_update_s": _time_weight_update(engine, args.model), "runs": runs}


def continuous_rate(engine, prompts: list, n: int, inflight: int, groups: int) -> dict:
    """The engine alone, kept at `inflight` sequences by continuous batching (groups of n
    submitted as sequences finish, prompts cycled) until `groups` groups have finished: their
    response tokens per second, and the mean sequences in flight. The engine is never left to
    drain: what is still in it at the end is aborted."""
    submitted = done = tokens = 0
    sequence_s = 0.0
    start = time.perf_counter()
    while done < groups:
        while engine.num_sequences + n <= inflight:
            engine.submit(f"c{submitted}", prompts[submitted % len(prompts)], n)
            submitted += 1
        sequences, step_start = engine.num_sequences, time.perf_counter()
        finished = engine.step()
        sequence_s += sequences * (time.perf_counter() - step_start)
        done += len(finished)
        tokens += sum(len(s.response_ids) for _, group in finished for s in group)
    wall = time.perf_counter() - start
    engine.abort([f"c{i}" for i in range(submitted)])
    return {"tokens_per_s": tokens / wall, "samples_per_s": done * n / wall, "tokens": tokens,
            "wall_s": wall, "mean_inflight": sequence_s / wall, "inflight": inflight}


def _time_weight_update(engine, model_path: str) -> float:
    """Seconds for one update_weights of the full model (tensors already in memory)."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(model_path) / "model.safetensors"))
    start = time.perf_counter()
    engine.update_weights(weights.items(), version=1)
    return time.perf_counter() - start


def _spawn(args: argparse.Namespace, engine: str, hf_threads: str) -> dict:
    argv = [sys.executable, "-m", "async_rlhf.launch.cli", "bench-gen", "--worker", engine,
            "--hf-threads", hf_threads]
    for key in ("preset", "model", "prompts", "max_new_tokens", "temperature", "vllm_threads",
                "repeats", "task"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench-gen {engine} worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    names = [f"{r['engine']} ({r['threads']} thr)" for r in results]
    ax.bar(names, [r["tokens_per_s"] for r in results], label="tokens/s")
    ax.bar(names, [r["tokens_per_s_per_thread"] for r in results], width=0.4, label="per thread")
    ax.set_ylabel("response tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from actors.model_init import ensure_model

    args.model = str(args.model or Path("runs/models") / args.preset)
    if args.worker:
        print(json.dumps(_measure(args)))
        return 0
    ensure_model(args.model, args.preset)
    engines = args.engines.split(",")
    results = [_spawn(args, "vllm", "1")] if "vllm" in engines else []
    if "hf" in engines:
        results += [_spawn(args, "hf", t) for t in args.hf_threads.split(",")]
    report = {"model": args.model, "preset": args.preset, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "results": results}
    hf = [r for r in results if r["engine"] == "hf"]
    if hf and results[0]["engine"] == "vllm":
        vllm_per_thread = results[0]["tokens_per_s_per_thread"]
        report["per_thread_speedup_by_hf_threads"] = {
            str(r["threads"]): vllm_per_thread / r["tokens_per_s_per_thread"] for r in hf
        }  # against transformers' best thread count (the headline figure):
        best = max(r["tokens_per_s_per_thread"] for r in hf)
        report["per_thread_speedup_vllm_over_hf"] = vllm_per_thread / best
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(results, out.with_suffix(".png"))
    print(f"{args.preset} model, {args.prompts} prompts x <= {args.max_new_tokens} new tokens "
          f"(ending at EOS), temperature {args.temperature}")
    for r in results:
        lengths = ", ".join(f"{x['mean_length']:.1f}" for x in r["runs"])
        eos = ", ".join(f"{x['ended_at_eos']:.0%}" for x in r["runs"])
        print(f"  {r['engine']:5s} threads {r['threads']}: {r['tokens_per_s']:7.0f} tok/s, "
              f"{r['tokens_per_s_per_thread']:7.0f} tok/s/thread (mean length {lengths}; "
              f"ended at EOS {eos}; startup {r['startup_s']:.1f} s; full weight update "
              f"{r['weight_update_s']:.2f} s)")
    if "per_thread_speedup_vllm_over_hf" in report:
        each = ", ".join(f"{v:.2f}x vs {k} thread(s)"
                         for k, v in report["per_thread_speedup_by_hf_threads"].items())
        print(f"  vLLM / transformers per thread: {each}; "
              f"vs the best: {report['per_thread_speedup_vllm_over_hf']:.2f}x")
    print(f"  -> {out}")
    return 0
