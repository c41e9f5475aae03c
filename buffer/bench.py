"""`async-rlhf bench-queue`: experience-stream throughput next to raw redis-py, in one run.

Produce: RedisExperienceQueue.put (encode + pipelined XADD in MULTI/EXEC + backlog check) vs
raw pipelined XADD of the same pre-encoded bytes. Consume: RedisExperienceQueue.get + ack
(XAUTOCLAIM check, XREADGROUP, decode + validate, owner-checked XACK + XDEL in Lua) vs raw
XREADGROUP + XACK. Each side runs `--rounds` times alternately on fresh streams, after a
warm-up; the median round is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=20_000, help="trajectories per round")
    parser.add_argument("--tokens", type=int, default=512, help="response tokens per trajectory")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512, help="entries per put / get call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", help="use this Redis instead of an embedded redis-server")
    parser.add_argument("--durable", action="store_true", help="embedded Redis with AOF everysec")
    parser.add_argument("--out", default="runs/bench-queue.json", help="JSON results file")


def _trajectories(n: int, tokens: int, prompt_tokens: int) -> list:
    import numpy as np

    from async_rlhf.types import Trajectory

    rng = np.random.default_rng(0)
    return [
        Trajectory(
            prompt_ids=rng.integers(0, 32_000, prompt_tokens, dtype=np.int32),
            response_ids=rng.integers(0, 32_000, tokens, dtype=np.int32),
            behavior_logprobs=-rng.random(tokens, dtype=np.float32),
            reward=float(i % 2), reward_parts={"correct": float(i % 2)}, policy_version=0,
            generator_id="bench", group_id=f"p{i // 4}", finished=True,
        )
        for i in range(n)
    ]


def _raw_round(client, payloads: list[bytes], batch: int) -> tuple[float, float]:
    stream, group = f"bench-raw-{uuid.uuid4().hex[:8]}", "g"
    client.xgroup_create(stream, group, id="0", mkstream=True)
    t0 = time.perf_counter()
    for start in range(0, len(payloads), batch):
        pipe = client.pipeline(transaction=False)
        for data in payloads[start : start + batch]:
            pipe.xadd(stream, {b"t": data})
        pipe.execute()
    t1 = time.perf_counter()
    consumed = 0
    while consumed < len(payloads):
        reply = client.xreadgroup(group, "c", {stream: ">"}, count=batch)
        ids = [entry_id for entry_id, _ in reply[0][1]]
        client.xack(stream, group, *ids)
        consumed += len(ids)
    t2 = time.perf_counter()
    client.delete(stream)
    return t1 - t0, t2 - t1


def _queue_round(client, trajs: list, batch: int) -> tuple[float, float]:
    from buffer.redis_stream import RedisExperienceQueue

    stream = f"bench-queue-{uuid.uuid4().hex[:8]}"
    queue = RedisExperienceQueue(client, "c", stream=stream, max_backlog=len(trajs) + batch,
                                 put_chunk=batch)
    t0 = time.perf_counter()
    for start in range(0, len(trajs), batch):
        queue.put(trajs[start : start + batch])
    t1 = time.perf_counter()
    consumed = 0
    while consumed < len(trajs):
        got = queue.get(batch)
        queue.ack([r.entry_id for r in got])
        consumed += len(got)
    t2 = time.perf_counter()
    stats = queue.stats()
    if stats.counters.get("trained") != len(trajs) or stats.pending or stats.backlog:
        raise RuntimeError(f"bench accounting is off: {stats}")
    client.delete(stream, queue.dead_stream, queue.counters_key)
    return t1 - t0, t2 - t1


def run(args: argparse.Namespace) -> int:
    import redis

    from buffer.codec import encode
    from buffer.redis_server import EmbeddedRedis

    trajs = _trajectories(args.n, args.tokens, args.prompt_tokens)
    payloads = [encode(t) for t in trajs]
    mb = sum(len(p) for p in payloads) / 1e6
    server = None if args.redis_url else EmbeddedRedis(durable=args.durable).start()
    url = args.redis_url or server.url
    client = redis.Redis.from_url(url, decode_responses=False)
    try:
        warm = min(args.n, 2 * args.batch)
        _raw_round(client, payloads[:warm], args.batch)
        _queue_round(client, trajs[:warm], args.batch)
        raw, queue = [], []
        for _ in range(args.rounds):
            raw.append(_raw_round(client, payloads, args.batch))
            queue.append(_queue_round(client, trajs, args.batch))
    finally:
        client.close()
        if server is not None:
            server.close()

    def rate(seconds: list[float]) -> dict[str, float]:
        s = statistics.median(seconds)
        return {"seconds": s, "traj_per_s": args.n / s, "mb_per_s": mb / s}

    results = {
        "n": args.n, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
        "batch": args.batch, "rounds": args.rounds, "bytes_per_traj": mb * 1e6 / args.n,
        "redis": "external" if args.redis_url else ("embedded, AOF everysec" if args.durable
                                                    else "embedded, no persistence"),
        "raw": {"produce": rate([r[0] for r in raw]), "consume": rate([r[1] for r in raw])},
        "queue": {"produce": rate([q[0] for q in queue]), "consume": rate([q[1] for q in queue])},
    }
    for side in ("produce", "consume"):
        results["queue"][side]["ratio_to_raw"] = (
            results["queue"][side]["traj_per_s"] / results["raw"][side]["traj_per_s"]
        )
    print(f"{args.n} trajectories x {args.tokens} tokens ({results['bytes_per_traj']:.0f} B each), "
          f"batch {args.batch}, median of {args.rounds} rounds, {results['redis']}")
    print(f"{'':28}{'traj/s':>10}{'MB/s':>9}{'vs raw':>9}")
    for name, key in (("raw redis-py", "raw"), ("RedisExperienceQueue", "queue")):
        for side in ("produce", "consume"):
            r = results[key][side]
            ratio = f"{r['ratio_to_raw']:.0%}" if "ratio_to_raw" in r else ""
            label = f"{name} {'put' if side == 'produce' else 'get+ack'}"
            print(f"{label:28}{r['traj_per_s']:>10.0f}{r['mb_per_s']:>9.1f}{ratio:>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0
