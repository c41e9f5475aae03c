"""Commands that act on a running job from another terminal: `status` and `stop` read and write
the job registry's files (its status snapshot, a stop request) and need no Ray; `add-generators`
joins the job's Ray cluster as a second driver, to place actors."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from async_rlhf.launch import cluster
from async_rlhf.messages import JobStatus


def _running(job: str) -> dict:
    """The job's registry entry, once its launcher is known to be alive (on this host)."""
    try:
        info = cluster.read_job_info(job)
    except cluster.JobNotFoundError as e:
        raise SystemExit(str(e)) from None
    if info.get("host") == socket.gethostname():
        try:
            os.kill(info["pid"], 0)
        except ProcessLookupError:
            raise SystemExit(f"job {job!r} is registered but its launcher (pid {info['pid']}) is gone: "
                             f"it ended without cleaning up; remove {cluster.jobs_dir() / job}.json") from None
    return info


def _coordinator(job: str):
    import ray

    info = _running(job)
    cluster.connect(info["ray_address"], namespace=info["namespace"], token_path=info["ray_token_path"])
    try:
        coordinator = ray.get_actor("coordinator")
        ray.get(coordinator.__ray_ready__.remote())
        return coordinator
    except (ValueError, ray.exceptions.RayActorError):
        raise SystemExit(f"job {job!r} is registered but its coordinator is gone: has it ended?") from None


def status(job: str) -> JobStatus | None:
    """The launcher's latest JobStatus (None before its first: the job is starting)."""
    _running(job)
    published = cluster.read_job_status(job)
    return None if published is None else JobStatus.from_json(published)


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
    if s is None:
        print(json.dumps({"job": args.job, "starting": True}) if args.json else
              f"job {args.job}: starting (Ray, the learner and the generators are coming up)")
    else:
        print(json.dumps(s.to_json(), indent=2, default=str) if args.json else "\n".join(s.lines(time.time())))
    return 0


def run_stop(args: argparse.Namespace) -> int:
    _running(args.job)
    cluster.request_stop(args.job, "`async-rlhf stop` from another terminal")
    print(f"job {args.job}: stop requested; it ends after the current learner step")
    return 0


def run_generators(args: argparse.Namespace) -> int:
    import ray

    if args.count <= 0:
        print(f"--count must be > 0, got {args.count}", file=sys.stderr)
        return 2
    from async_rlhf.launch.roles import SETTLED

    coordinator = _coordinator(args.job)
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
