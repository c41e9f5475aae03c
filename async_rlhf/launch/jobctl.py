"""Commands that act on a running job from another terminal or node (second Ray drivers):
`status`, `stop`, `add-generators`. They find the job by name in the job registry."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _coordinator(job: str):
    import ray

    from async_rlhf.launch import cluster

    info = cluster.read_job_info(job)
    cluster.connect(info["ray_address"], namespace=info["namespace"], token_path=info["ray_token_path"])
    try:
        coordinator = ray.get_actor("coordinator")
        ray.get(coordinator.stop_requested.remote())
        return info, coordinator
    except (ValueError, ray.exceptions.RayActorError):
        raise SystemExit(f"job {job!r} is registered but its coordinator is gone: has it ended?") from None


def status(job: str) -> dict[str, Any]:
    import ray

    from async_rlhf.config import load_config, redact_url
    from buffer.redis_stream import RedisExperienceQueue

    info, coordinator = _coordinator(job)
    snap = ray.get(coordinator.get_snapshot.remote())
    cfg = load_config(f"{info['out']}/config.yaml")
    queue = RedisExperienceQueue.from_config(cfg.queue, info["redis_url"], consumer="status").accounting()
    return {"job": job, "learner": snap.get("learner", {}), "generators": snap.get("generators", []),
            "generator_restarts": snap.get("generator_restarts", 0), "requests": snap["requests"],
            "gate": snap["gate"], "queue": {"redis_url": redact_url(info["redis_url"]), "stream": cfg.queue.stream,
                                            **queue}}


def _print_status(s: dict[str, Any]) -> None:
    learner = s["learner"]
    print(f"job {s['job']}: learner step {learner.get('step', '?')} "
          f"policy_version {learner.get('policy_version', '?')}  restarts: learner "
          f"{learner.get('restarts', 0)}, generators {s['generator_restarts']}")
    for g in s["generators"]:
        print(f"  {g['generator_id']:>8}  node {g['node']}  pid {g['pid']}  "
              f"policy_version {g['policy_version']}  produced {g['produced']}"
              f"{'  ERROR' if g.get('error') else ''}")
    for i, state in s.get("requests", {}).items():
        print(f"  generator request {i}: {state}")
    q = s["queue"]
    print(f"queue {q['redis_url']} stream {q['stream']}: backlog+pending "
          f"{q['left_in_queue']}, produced {q['produced']}, trained {q['trained']}, "
          f"dead letters {q['dead_lettered']}")


def add_stop_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="the job's name (train --job)")


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    add_stop_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")


def add_generators_arguments(parser: argparse.ArgumentParser) -> None:
    add_stop_arguments(parser)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--resources", type=json.loads, default=None,
                        help='Ray resources for placement, e.g. \'{"node_b": 1}\'')
    parser.add_argument("--wait-s", type=float, default=10.0,
                        help="how long to wait for the requests to be placed before reporting")


def run_status(args: argparse.Namespace) -> int:
    s = status(args.job)
    if args.json:
        print(json.dumps(s, indent=2, default=str))
    else:
        _print_status(s)
    return 0


def run_stop(args: argparse.Namespace) -> int:
    import ray

    _, coordinator = _coordinator(args.job)
    ray.get(coordinator.request_stop.remote("`async-rlhf stop` from another driver"))
    print(f"job {args.job}: stop requested; it ends after the current learner step")
    return 0


def run_generators(args: argparse.Namespace) -> int:
    import ray

    if args.count <= 0:
        print(f"--count must be > 0, got {args.count}", file=sys.stderr)
        return 2
    from async_rlhf.launch.roles import SETTLED

    _, coordinator = _coordinator(args.job)
    ids = ray.get(coordinator.request_generators.remote(args.count, args.resources))
    print(f"job {args.job}: {args.count} generator(s) requested; they join the next membership "
          "epoch once their engine is up")
    deadline = time.monotonic() + args.wait_s  # the launcher places requests within a second
    while True:
        states = ray.get(coordinator.placement.remote(ids))
        if all(s.startswith(SETTLED) for s in states.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for i, state in states.items():
        print(f"  request {i}: {state}")
    return 1 if any(s.startswith(("refused", "failed")) for s in states.values()) else 0
