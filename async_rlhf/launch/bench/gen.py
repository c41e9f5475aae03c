"""`async-rlhf bench-gen`: generation throughput, vLLM engine vs the transformers engine.

Both engines get the same prompts (built-in task prompts, tokenized with the model's tokenizer),
sample with the same settings, and stop at EOS or max_new_tokens, so response lengths vary as in
real use. Each engine runs in its own fresh subprocess (the in-process vLLM engine pins this
process's threads and memory policy: harness.in_child), is warmed up once, then timed `--repeats` times. Tokens are
response tokens actually produced (EOS included, padding not). Reported: tokens/s, tokens/s per
thread, mean response length, share of responses that ended at EOS, and the per-thread speedup
of vLLM over transformers at its best thread count (`--hf-threads 1,2` runs both: on a busy
machine 2 OpenMP threads can be several times slower than 1, since they wait on each other);
written as JSON and a PNG bar chart.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from async_rlhf.launch.bench.harness import figure, in_child, save, warm_then_time
from async_rlhf.synthetic import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
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


@dataclass(frozen=True)
class Timed:
    seconds: float
    tokens: int  # response tokens produced, EOS included
    tokens_per_s: float
    mean_length: float
    ended_at_eos: float  # share of responses


@dataclass(frozen=True)
class EngineResult:
    engine: str
    threads: int
    torch_threads_seen: int
    startup_s: float
    tokens_per_s: float
    tokens_per_s_per_thread: float
    weight_update_s: float
    runs: list[Timed]


@dataclass(frozen=True)
class GenReport:
    model: str
    preset: str
    prompts: int
    max_new_tokens: int
    temperature: float
    results: list[EngineResult]
    per_thread_speedup_by_hf_threads: dict[str, float] | None  # vLLM over transformers at N threads
    per_thread_speedup_vllm_over_hf: float | None  # over transformers' best thread count


def measure(args: argparse.Namespace, engine_name: str, threads: int) -> EngineResult:
    """One engine, in its own process (in_child)."""
    import torch
    from transformers import AutoTokenizer

    from actors.engines import make_engine
    from actors.tasks import examples
    from async_rlhf.config import GeneratorConfig
    from async_rlhf.types import Prompt

    cfg = GeneratorConfig(engine=engine_name, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, threads=threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [Prompt(f"b{i}", tuple(tok(t)["input_ids"]), t, a)
               for i, (t, a) in enumerate(examples(args.task, 0, args.prompts))]
    start = time.perf_counter()
    engine = make_engine(cfg, args.model, seed=0)
    startup_s = time.perf_counter() - start
    runs = []
    for seconds, groups in warm_then_time(lambda: engine.generate(prompts, 1), warmup=1, repeats=args.repeats):
        samples = [g[0] for g in groups]
        tokens = sum(len(s.response_ids) for s in samples)
        runs.append(Timed(seconds, tokens, tokens / seconds, tokens / len(samples),
                          sum(s.finished for s in samples) / len(samples)))
    tps = sum(r.tokens for r in runs) / sum(r.seconds for r in runs)
    return EngineResult(engine_name, threads, torch.get_num_threads(), startup_s, tps, tps / threads,
                        _time_weight_update(engine, args.model), runs)


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


def _plot(report: GenReport, path: Path) -> None:
    with figure(path, figsize=(5, 3)) as ax:
        names = [f"{r.engine} ({r.threads} thr)" for r in report.results]
        ax.bar(names, [r.tokens_per_s for r in report.results], label="tokens/s")
        ax.bar(names, [r.tokens_per_s_per_thread for r in report.results], width=0.4, label="per thread")
        ax.set_ylabel("response tokens / s")
        ax.legend()


def run(args: argparse.Namespace) -> int:
    from actors.model_init import ensure_model

    args.model = str(args.model or Path("runs/models") / args.preset)
    ensure_model(args.model, args.preset)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    engines = args.engines.split(",")
    todo = ([("vllm", args.vllm_threads)] if "vllm" in engines else []) + (
        [("hf", int(t)) for t in args.hf_threads.split(",")] if "hf" in engines else [])
    results = [in_child(measure, args, name, threads, log=out.with_name(f"{out.stem}-{name}-{threads}.log"))
               for name, threads in todo]
    hf = [r for r in results if r.engine == "hf"]
    vllm = next((r.tokens_per_s_per_thread for r in results if r.engine == "vllm"), None)
    report = GenReport(args.model, args.preset, args.prompts, args.max_new_tokens, args.temperature, results,
                       {str(r.threads): vllm / r.tokens_per_s_per_thread for r in hf} if hf and vllm else None,
                       vllm / max(r.tokens_per_s_per_thread for r in hf) if hf and vllm else None)
    print(f"{args.preset} model, {args.prompts} prompts x <= {args.max_new_tokens} new tokens "
          f"(ending at EOS), temperature {args.temperature}")
    for r in results:
        lengths = ", ".join(f"{x.mean_length:.1f}" for x in r.runs)
        eos = ", ".join(f"{x.ended_at_eos:.0%}" for x in r.runs)
        print(f"  {r.engine:5s} threads {r.threads}: {r.tokens_per_s:7.0f} tok/s, "
              f"{r.tokens_per_s_per_thread:7.0f} tok/s/thread (mean length {lengths}; "
              f"ended at EOS {eos}; startup {r.startup_s:.1f} s; full weight update "
              f"{r.weight_update_s:.2f} s)")
    if report.per_thread_speedup_vllm_over_hf is not None:
        each = ", ".join(f"{v:.2f}x vs {k} thread(s)" for k, v in report.per_thread_speedup_by_hf_threads.items())
        print(f"  vLLM / transformers per thread: {each}; vs the best: {report.per_thread_speedup_vllm_over_hf:.2f}x")
    save(report, out, plot=_plot)
    return 0
