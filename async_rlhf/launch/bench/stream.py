"""`async-rlhf bench-queue`: experience-stream throughput next to raw redis-py, in one run.

Each stream entry is one group of --group-size trajectories (schema v2); rates are given in
trajectories per second (entries/s = that / group size) and MB/s. The figures quoted below were
measured with schema v1 (one trajectory per entry).

Produce: RedisExperienceQueue.put (encode + pipelined XADDs in MULTI/EXEC + counter + backlog
measure) vs raw pipelined XADD of the same pre-encoded bytes. Consume: RedisExperienceQueue.get +
ack (XAUTOCLAIM check, XREADGROUP, decode + validate, owner-checked XACK + XDEL in Lua) vs raw
XREADGROUP + XACK. A third row, raw + codec, adds encode/decode to the raw loop: the difference
between it and the queue is the queue's own bookkeeping, the rest is the codec. Rounds run
interleaved on fresh streams after a warm-up; the median is reported.

Where the time goes (2 busy cores, 4.7 KB entries, per trajectory, measured with perf_counter
around each step): raw XREADGROUP ~12-14 us (mostly redis-py's pure-Python reply parser) + XACK
~1.5 us; decode_batch + validate ~5 us (msgspec ~1 us, the arrays ~1 us, the rest Python glue);
the queue's owner-checked XACK + XDEL in Lua ~4 us in all (server: XDEL ~0.8, ownership check
~1.5) and its XAUTOCLAIM check ~0.25 us. Produce: raw pipelined XADD ~16-18 us, encode ~3-4 us,
MULTI/EXEC ~1.5 us (one +QUEUED reply parsed per XADD). Decoding costs a third of the raw read,
so get+ack cannot reach 80% of a raw loop that never decodes; compare it with the raw + codec
row as well.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from async_rlhf.launch.bench.harness import save


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=20_000, help="trajectories per round")
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per group (stream entry)")
    parser.add_argument("--tokens", type=int, default=512, help="response tokens per trajectory")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=128, help="entries (groups) per put / get call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", help="use this Redis instead of an embedded redis-server")
    parser.add_argument("--durable", action="store_true", help="embedded Redis with AOF everysec")
    parser.add_argument("--out", default="runs/bench-queue.json", help="JSON results file")


def _raw_round(client, groups: list, payloads: list[bytes], batch: int, codec: bool):
    """Raw redis-py: pipelined XADD, XREADGROUP + XACK. With `codec`, also encode before the
    XADDs and decode (and validate) after the reads: the queue's work minus its bookkeeping."""
    from buffer.codec import decode_batch, encode

    stream, group = f"bench-raw-{uuid.uuid4().hex[:8]}", "g"
    client.xgroup_create(stream, group, id="0", mkstream=True)
    t0 = time.perf_counter()
    for start in range(0, len(payloads), batch):
        chunk = [encode(g) for g in groups[start : start + batch]] if codec else payloads[start : start + batch]
        pipe = client.pipeline(transaction=False)
        for data in chunk:
            pipe.xadd(stream, {b"t": data})
        pipe.execute()
    t1 = time.perf_counter()
    consumed = 0
    while consumed < len(payloads):
        reply = client.xreadgroup(group, "c", {stream: ">"}, count=batch)
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        if codec:  # kept until the next read, as a consumer keeps the batch it trains on
            batch_groups = decode_batch([fields[b"t"] for _, fields in entries])  # noqa: F841
        client.xack(stream, group, *[entry_id for entry_id, _ in entries])
        consumed += len(entries)
    t2 = time.perf_counter()
    client.delete(stream)
    return t1 - t0, t2 - t1


def _queue_round(client, groups: list, batch: int) -> tuple[float, float]:
    from buffer.redis_stream import RedisExperienceQueue

    stream = f"bench-queue-{uuid.uuid4().hex[:8]}"
    queue = RedisExperienceQueue(client, "c", stream=stream, max_backlog=len(groups) + batch,
                                 put_chunk=batch)
    t0 = time.perf_counter()
    for start in range(0, len(groups), batch):
        queue.put(groups[start : start + batch])
    t1 = time.perf_counter()
    consumed = 0
    while consumed < len(groups):
        got = queue.get(batch)
        queue.ack([r.entry_id for r in got])
        consumed += len(got)
    t2 = time.perf_counter()
    stats = queue.stats()
    if stats.counters.get("trained") != len(groups) or stats.pending or stats.backlog:
        raise RuntimeError(f"bench accounting is off: {stats}")
    client.delete(stream, queue.dead_stream, queue.counters_key)
    return t1 - t0, t2 - t1


@dataclass(frozen=True)
class Rate:
    """One path's median round, and its ratio to the raw loops (the queue's, raw + codec's)."""

    seconds: float
    traj_per_s: float
    mb_per_s: float
    ratio_to_raw: float | None = None
    ratio_to_raw_codec: float | None = None


@dataclass(frozen=True)
class QueueReport:
    n: int
    group_size: int
    tokens: int
    prompt_tokens: int
    batch: int
    rounds: int
    bytes_per_traj: float
    redis: str
    raw: dict[str, Rate]  # produce, consume
    raw_codec: dict[str, Rate]
    queue: dict[str, Rate]


def _print_table(r: QueueReport) -> None:
    """The results as a table: rates and their ratios to the raw loops."""
    print(f"{r.n} trajectories x {r.tokens} tokens ({r.bytes_per_traj:.0f} B each) in groups of "
          f"{r.group_size}, batch {r.batch} groups, median of {r.rounds} rounds, {r.redis}")
    print(f"{'':34}{'traj/s':>9}{'MB/s':>8}{'vs raw':>8}{'vs raw+codec':>14}")
    rows = (("raw redis-py", r.raw), ("raw redis-py + codec", r.raw_codec), ("RedisExperienceQueue", r.queue))
    for side, verb in (("produce", "put"), ("consume", "get+ack")):
        for name, path in rows:
            x = path[side]
            ratio = f"{x.ratio_to_raw:.0%}" if x.ratio_to_raw is not None else ""
            ratio_codec = f"{x.ratio_to_raw_codec:.0%}" if x.ratio_to_raw_codec is not None else ""
            print(f"{name + ' ' + verb:34}{x.traj_per_s:>9.0f}{x.mb_per_s:>8.1f}{ratio:>8}{ratio_codec:>14}")


def run(args: argparse.Namespace) -> int:
    import redis

    from async_rlhf.synthetic import random_groups
    from buffer.codec import encode
    from buffer.redis_server import EmbeddedRedis

    groups = random_groups(args.n // args.group_size, vocab=32_000, prompt_len=args.prompt_tokens,
                           response_len=args.tokens, group_size=args.group_size)
    args.n = len(groups) * args.group_size  # whole groups
    payloads = [encode(g) for g in groups]
    mb = sum(len(p) for p in payloads) / 1e6
    server = None if args.redis_url else EmbeddedRedis(durable=args.durable).start()
    url = args.redis_url or server.url
    client = redis.Redis.from_url(url, decode_responses=False)
    rounds: dict[str, list[tuple[float, float]]] = {"raw": [], "raw_codec": [], "queue": []}
    try:
        warm = min(len(groups), 2 * args.batch)
        _raw_round(client, groups[:warm], payloads[:warm], args.batch, codec=True)
        _queue_round(client, groups[:warm], args.batch)
        for _ in range(args.rounds):  # interleaved, so that load changes hit all three alike
            rounds["raw"].append(_raw_round(client, groups, payloads, args.batch, codec=False))
            rounds["raw_codec"].append(_raw_round(client, groups, payloads, args.batch, codec=True))
            rounds["queue"].append(_queue_round(client, groups, args.batch))
    finally:
        client.close()
        if server is not None:
            server.close()

    def rates(times: list[tuple[float, float]], raw=None, raw_codec=None) -> dict[str, Rate]:
        out = {}
        for i, side in enumerate(("produce", "consume")):
            s = statistics.median(t[i] for t in times)
            out[side] = Rate(s, args.n / s, mb / s, raw and raw[side].seconds / s,
                             raw_codec and raw_codec[side].seconds / s)
        return out

    raw = rates(rounds["raw"])
    raw_codec = rates(rounds["raw_codec"], raw)
    report = QueueReport(args.n, args.group_size, args.tokens, args.prompt_tokens, args.batch, args.rounds,
                         mb * 1e6 / args.n,
                         "external" if args.redis_url else ("embedded, AOF everysec" if args.durable
                                                            else "embedded, no persistence"),
                         raw, raw_codec, rates(rounds["queue"], raw, raw_codec))
    _print_table(report)
    save(report, Path(args.out))
    return 0
