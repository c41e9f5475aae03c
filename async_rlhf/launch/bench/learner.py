"""`async-rlhf bench-learner`: learner throughput and where its time goes.

Builds a preset-shaped random-init Llama in-process (no download), feeds the real Learner and
DeepSpeed backend pre-generated random groups of trajectories from memory (no Redis: this measures learner
compute; `bench-queue` measures the stream), warms up, then times steps: trained samples/s,
response tokens/s, and the share of each step spent waiting, recomputing pi_prox, in the train
forward, backward, optimizer step and the full-weight gather for the weight sync. Several ZeRO
stages and precisions (learner.mixed_precision) can be compared in one run, beside a plain
step on the same batches: a Hugging Face forward over the responses (`logits_to_keep`, as TRL
computes its log-probs), a policy-gradient loss, backward, clipping and torch AdamW, which is what
a standard trainer pays per sample, in float32 and under bf16 autocast. Writes JSON + PNG.

The data feed: groups held in memory, handed to the learner through the ExperienceQueue and
ReplayBuffer protocols without Redis (tests use the real Redis stream and replay buffer).
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from async_rlhf.launch.bench.harness import figure, save, warm_then_time
from async_rlhf.messages import StepTimes
from async_rlhf.protocols import QueueStats, ReplayDraw
from async_rlhf.synthetic import PRESETS
from async_rlhf.types import Group, Received, TrajectoryError

PHASES = tuple(f.name for f in dataclasses.fields(StepTimes) if f.name != "checkpoint")  # no checkpoints here


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--model", help="a model directory to train instead of a preset (e.g. bench-memory's)")
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[0], help="one or more stages to compare")
    parser.add_argument("--batch-size", type=int, default=16, help="trajectories per step")
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per group (GRPO's n)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--response-len-min", type=int,
                        help="responses of lengths drawn from this to --response-len (default: all that long)")
    parser.add_argument("--packing", nargs="+", default=["on"], choices=["on", "off"],
                        help="learner.packing settings to compare (rows packed, or padded)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--mixed-precision", nargs="+", default=["fp32", "bf16"], choices=["auto", "bf16", "fp32"],
                        help="learner.mixed_precision settings to compare (float32 weights)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain Hugging Face step")
    parser.add_argument("--out", default="runs/bench/learner.json")


class NullPublisher:
    """Consumes the gathered weights like a broadcast would, without sending them."""

    def publish(self, named_tensors, version):
        for _ in named_tensors:
            pass


class PreloadedQueue:
    """ExperienceQueue over groups put in memory. The learner is its one consumer, so every
    entry it gets stays its own (renew keeps all); acks just count."""

    def __init__(self) -> None:
        self._entries: collections.deque[Received] = collections.deque()
        self._next = 0
        self.acked: collections.Counter[str] = collections.Counter()  # reason -> groups

    def put(self, groups: Sequence[Group], timeout_s: float | None = None) -> None:
        for g in groups:
            self._entries.append(Received(f"{self._next}-0", g))
            self._next += 1

    def get(self, count: int, block_ms: int = 1000) -> list[Received]:
        return [self._entries.popleft() for _ in range(min(count, len(self._entries)))]

    def ack(self, entry_ids: Sequence[str], reason: str = "trained") -> None:
        self.acked[reason] += len(entry_ids)

    def renew(self, entry_ids: Sequence[str]) -> list[str]:
        return list(entry_ids)

    def duplicates(self, received: Sequence[Received]) -> list[str]:
        return []  # every group the bench puts is a distinct one

    def reject(self, rejected: Sequence[tuple[Received, TrajectoryError]]) -> None:
        raise RuntimeError(f"bench-learner data was rejected: {rejected[0][1]}")

    def dead_letter(self, reason: str, detail: str, payload: bytes = b"") -> None:
        raise RuntimeError(f"bench-learner data was set aside ({reason}: {detail})")

    def stats(self) -> QueueStats:
        return QueueStats(len(self._entries), 0, 0, dict(self.acked))


class OnceReplay:
    """ReplayBuffer that hands out each group once, in arrival order, with no staleness logic
    (the bench stamps every group with the version that trains it)."""

    def __init__(self) -> None:
        self._items: collections.deque[Received] = collections.deque()

    def add(self, items: Sequence[Received]) -> None:
        self._items.extend(items)

    def draw(self, count: int, version: int) -> ReplayDraw:
        items = [self._items.popleft() for _ in range(min(count, len(self._items)))]
        return ReplayDraw(items=items, first_use=[r.entry_id for r in items], dropped=[])

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class StageResult:
    setting: str  # "ZeRO-<stage> <mixed_precision>", or "plain HF <precision>"
    params_m: float
    steps: int
    wall_s: float
    samples_per_s: float
    response_tokens_per_s: float
    all_tokens_per_s: float
    share: dict[str, float]  # of the timed wall time, per phase
    seconds: dict[str, float]
    pad_share: float | None = None  # of the positions the training forwards computed (the learner's)


@dataclass(frozen=True)
class LearnerReport:
    setup: dict
    results: list[StageResult]


def _groups(args: argparse.Namespace, n: int) -> list[Group]:
    from async_rlhf.synthetic import CHAR_VOCAB_SIZE, random_groups

    return random_groups(n, vocab=CHAR_VOCAB_SIZE, prompt_len=args.prompt_len, response_len=args.response_len,
                         group_size=args.group_size, min_response_len=args.response_len_min)


def _result(args, setting: str, params: int, timed: list, samples: int, tokens: int, totals: dict) -> StageResult:
    wall = sum(t for t, _ in timed)
    return StageResult(setting, round(params / 1e6, 2), args.steps, round(wall, 3), round(samples / wall, 3),
                       round(tokens / wall, 1), round((samples * args.prompt_len + tokens) / wall, 1),
                       {p: round(totals.get(p, 0.0) / wall, 3) for p in PHASES},
                       {p: round(totals.get(p, 0.0), 3) for p in PHASES})


def _model(args: argparse.Namespace):
    from async_rlhf.synthetic import build_model

    if not args.model:
        return build_model(args.preset)
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)


def bench_one(args: argparse.Namespace, zero_stage: int, mixed_precision: str,
              overrides: dict | None = None) -> StageResult:
    """The learner's steps at `zero_stage` and `mixed_precision`, with other LearnerConfig
    `overrides` (bench-memory's settings; learner.packing)."""
    from async_rlhf.config import LearnerConfig
    from learners.deepspeed_backend import DeepSpeedBackend
    from learners.learner import Learner

    cfg = LearnerConfig(**{"batch_size": args.batch_size, "micro_batch": args.micro_batch,
                           "steps": args.warmup + args.steps, "mixed_precision": mixed_precision,
                           **(overrides or {}), "zero_stage": zero_stage})
    model = _model(args)
    params = sum(p.numel() for p in model.parameters())
    backend = DeepSpeedBackend(cfg, model, dtype=args.dtype)
    queue = PreloadedQueue()
    learner = Learner(cfg, backend, max_staleness=0, group_size=args.group_size, queue=queue,
                      replay=OnceReplay(), publisher=NullPublisher())
    per_batch = cfg.batch_size // args.group_size
    n = per_batch * cfg.steps  # groups
    groups = _groups(args, n)
    for i in range(cfg.steps):  # stamp each batch with the version that will train it
        queue.put([g.with_version(i) for g in groups[i * per_batch:(i + 1) * per_batch]])
    timed = warm_then_time(learner.step, warmup=args.warmup, repeats=args.steps)
    history = [m for _, m in timed]
    if dict(queue.acked) != {"trained": n}:  # anything dropped would make the numbers lie
        raise RuntimeError(f"bench-learner expected {n} groups trained, got {dict(queue.acked)}")
    totals = dataclasses.asdict(StepTimes.total(m.times for m in history))
    rows = "packed" if backend._packs() else "padded"
    result = _result(args, f"ZeRO-{zero_stage} {backend.autocast or args.dtype} {rows}".replace("torch.", ""),
                     params, timed, sum(m.samples for m in history), sum(m.tokens for m in history), totals)
    return dataclasses.replace(result, pad_share=round(sum(m.extra["pad_share"] for m in history) / len(history), 3))


def bench_plain(args: argparse.Namespace, autocast: bool) -> StageResult:
    """A plain Hugging Face step on the same batches: forward over the responses, the token
    policy-gradient loss, backward per micro-batch, gradient clipping and one AdamW step."""
    import time

    import torch

    from learners.batch import Batch

    model = _model(args).train()
    model.config.use_cache = False
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    per_batch = args.batch_size // args.group_size
    batches = [Batch.from_received([Received(str(i), g) for i, g in enumerate(_groups(args, per_batch))])
               for _ in range(args.warmup + args.steps)]
    totals: collections.Counter[str] = collections.Counter()

    def step():
        batch = batches.pop()
        totals["tokens"] += int(batch.mask.sum())
        for s in range(0, args.batch_size, args.micro_batch):
            mb = batch.rows(torch.arange(s, s + args.micro_batch))
            t = time.perf_counter()
            keep = mb.input_ids.shape[1] - int(mb.positions.min())
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                               logits_to_keep=keep).logits
            logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, mb.input_ids[:, -keep + 1:, None])
            loss = -(logp[..., 0] * mb.mask[:, -keep + 1:]).sum() / batch.mask.sum()
            totals["forward"] += time.perf_counter() - t
            t = time.perf_counter()
            loss.backward()
            totals["backward"] += time.perf_counter() - t
        t = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        totals["step"] += time.perf_counter() - t

    warm_then_time(step, warmup=args.warmup, repeats=0)
    totals.clear()
    timed = warm_then_time(step, warmup=0, repeats=args.steps)
    return _result(args, f"plain HF {'bf16 autocast' if autocast else 'float32'}", params, timed,
                   args.steps * args.batch_size, totals.pop("tokens"), totals)


def _plot(report: LearnerReport, path: Path) -> None:
    results = report.results
    with figure(path, figsize=(6, 1.2 + 0.5 * len(results))) as ax:
        labels = [r.setting for r in results]
        left = [0.0] * len(results)
        for p in PHASES:
            widths = [r.share[p] for r in results]
            ax.barh(labels, widths, left=left, label=p)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlabel("share of step time")
        ax.legend(fontsize=7, ncol=len(PHASES), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    results = [bench_one(args, stage, mp, {"packing": packing == "on"})
               for stage in args.zero_stage for mp in args.mixed_precision for packing in args.packing]
    if not args.no_plain:
        results += [bench_plain(args, autocast) for autocast in (False, True)]
    report = LearnerReport({k: v for k, v in vars(args).items() if k not in ("func", "command")}, results)
    for r in report.results:
        shares = "  ".join(f"{p} {100 * r.share[p]:.0f}%" for p in PHASES)
        pad = "" if r.pad_share is None else f", padding {100 * r.pad_share:.0f}% of positions"
        print(f"{r.setting} {r.params_m}M params: {r.samples_per_s} samples/s, "
              f"{r.response_tokens_per_s} response tok/s, {r.all_tokens_per_s} tok/s{pad} | {shares}")
    save(report, Path(args.out), plot=_plot)
    return 0
