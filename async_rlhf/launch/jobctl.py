"""Commands that act on a running job from another terminal or node (second Ray drivers):
`status`, `stop`, `add-generators`. They find the job by name in the job registry."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from async_rlhf.messages import Accounting, CoordinatorSnapshot


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


@dataclass(frozen=True)
class JobStatus:
    """`async-rlhf status`: the coordinator's snapshot and the stream's accounting."""

    job: str
    coordinator: CoordinatorSnapshot
    redis_url: str  # password redacted
    stream: str
    queue: Accounting

    def to_json(self) -> dict[str, Any]:
        c, snap = self.coordinator, self.coordinator.job
        return {"job": self.job, "learner": dataclasses.asdict(snap.learner) if snap else {},
                "generators": [g.to_json() for g in snap.generators] if snap else [],
                "generator_restarts": snap.generator_restarts if snap else 0, "requests": dict(c.requests),
                "gate": {"accepted": c.gate_accepted, "running": c.gate_running},
                "queue": {"redis_url": self.redis_url, "stream": self.stream, **self.queue.to_json()}}

    def lines(self) -> list[str]:
        snap, q = self.coordinator.job, self.queue
        if snap is None:
            out = [f"job {self.job}: learner step ? policy_version ?  restarts: learner 0, generators 0"]
        else:
            learner = snap.learner
            out = [f"job {self.job}: learner step {learner.step} policy_version {learner.policy_version}  "
                   f"restarts: learner {learner.restarts}, generators {snap.generator_restarts}"]
            out += [f"  {g.generator_id:>8}  node {g.node}  pid {g.pid}  policy_version {g.policy_version}  "
                    f"produced {g.produced}{'  ERROR' if g.error else ''}" for g in snap.generators]
        out += [f"  generator request {i}: {state}" for i, state in self.coordinator.requests.items()]
        out.append(f"queue {self.redis_url} stream {self.stream}: backlog+pending {q.left_in_queue}, "
                   f"produced {q.produced}, trained {q.trained}, dead letters {q.dead_lettered}")
        return out


def status(job: str) -> JobStatus:
    import ray

    from async_rlhf.config import load_config, redact_url
    from buffer.redis_stream import RedisExperienceQueue

    info, coordinator = _coordinator(job)
    snap = ray.get(coordinator.get_snapshot.remote())
    cfg = load_config(f"{info['out']}/config.yaml")
    queue = RedisExperienceQueue.from_config(cfg.queue, info["redis_url"], consumer="status")
    return JobStatus(job, snap, redact_url(info["redis_url"]), cfg.queue.stream, queue.accounting())


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
    print(json.dumps(s.to_json(), indent=2, default=str) if args.json else "\n".join(s.lines()))
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
