"""Real Ray on loopback: head node, second driver in another process, a second raylet, clean stop.

Also the job registry (no Ray).
"""

import ast
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_rlhf.launch import groups
from async_rlhf.launch.cluster import (
    JobNotFoundError,
    connect,
    read_job_info,
    read_job_status,
    remove_job_info,
    start_local_cluster,
    stop_request,
    write_job_info,
    write_job_status,
)
from ray_nodes import start_worker_node


def test_job_registry_roundtrip_mode_and_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RLHF_HOME", str(tmp_path))
    info = {"ray_address": "127.0.0.1:6379", "redis_url": "redis://127.0.0.1:1/0",
            "out_dir": "/tmp/out", "pid": 123}
    path = write_job_info("demo-1", info)
    assert path == tmp_path / "jobs" / "demo-1.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_job_info("demo-1") == {"job": "demo-1", **info}
    remove_job_info("demo-1")
    with pytest.raises(JobNotFoundError, match=r"no running job named 'demo-1'.*"
                       r"`async-rlhf train --job demo-1`"):
        read_job_info("demo-1")
    with pytest.raises(ValueError, match="job name must match"):
        write_job_info("../etc", info)


STOP = """
import sys
from async_rlhf.launch.cli import main
code = main(['stop', '--job', sys.argv[1]])
print(code, [m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules])
"""


def test_stop_leaves_a_request_for_a_live_launcher_without_joining_ray(tmp_path, monkeypatch):
    """`stop` writes the job's stop request (the launcher reads it after each step); a launcher
    that is gone is named, and nothing is requested of it."""
    monkeypatch.setenv("ASYNC_RLHF_HOME", str(tmp_path))
    ended = subprocess.Popen(["true"])  # a pid that no longer runs
    ended.wait()
    host = socket.gethostname()
    write_job_info("gone", {"pid": ended.pid, "host": host})
    write_job_info("live", {"pid": os.getpid(), "host": host})
    write_job_status("live", {"job": None})

    def stop(job):
        return subprocess.run([sys.executable, "-c", STOP, job], capture_output=True, text=True, timeout=60)

    done = stop("live")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 []"
    assert stop_request("live") == "`async-rlhf stop` from another terminal"
    gone = stop("gone")
    assert gone.returncode == 1 and f"its launcher (pid {ended.pid}) is gone" in gone.stderr
    assert stop_request("gone") == ""
    write_job_info("live", {"pid": os.getpid(), "host": host})  # a new job of that name
    assert stop_request("live") == "" and read_job_status("live") is None
    remove_job_info("live")
    assert [p.name for p in (tmp_path / "jobs").iterdir()] == ["gone.json"]


SECOND_DRIVER = """
import sys, time, json
t0 = time.perf_counter()
from async_rlhf.launch.cluster import connect
import ray
connect(sys.argv[1], namespace="job-a", token_path=sys.argv[2] if len(sys.argv) > 2 else None)
t1 = time.perf_counter()
actor = ray.get_actor("pinger")
print(json.dumps({"reply": ray.get(actor.ping.remote("from-second-driver")),
                  "connect_s": t1 - t0, "node_ip": ray.util.get_node_ip_address()}))
"""


def _listening_addresses(pids):
    out = subprocess.run(["ss", "-Htlnup"], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            found.add(line.split()[4].rsplit(":", 1)[0])
    return found


def _rss_mib(pids):
    total = 0
    for pid in pids:
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cluster_second_driver_and_worker_node(tmp_path):
    import ray

    ray_home = Path.home() / ".ray"  # an empty HOME (tests/conftest.py): no token file to lean on
    assert not ray_home.exists()
    t0 = time.perf_counter()
    cluster = start_local_cluster(num_cpus=1)
    start_s = time.perf_counter() - t0
    node = None
    try:
        assert cluster.address.startswith("127.0.0.1:")
        assert stat.S_IMODE(cluster.token_path.stat().st_mode) == 0o600
        connect(cluster.address, namespace="job-a", token_path=cluster.token_path)
        head_node_id = ray.get_runtime_context().get_node_id()

        @ray.remote(num_cpus=0)
        class Pinger:
            def ping(self, msg):
                return f"pong {msg}"

            def node_id(self):
                return ray.get_runtime_context().get_node_id()

        pinger = Pinger.options(name="pinger", lifetime="detached").remote()
        assert ray.get(pinger.ping.remote("x")) == "pong x"

        # A second driver in a fresh process finds the named actor given just the address.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        t_driver = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", SECOND_DRIVER, cluster.address, cluster.token_path],
                              capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        driver_s = time.perf_counter() - t_driver
        second = json.loads(proc.stdout.strip().splitlines()[-1])
        assert second["reply"] == "pong from-second-driver"
        assert second["node_ip"] == "127.0.0.1"
        # Without the job's token (another user, say), a driver is turned away.
        stranger = subprocess.run([sys.executable, "-c", SECOND_DRIVER, cluster.address],
                                  capture_output=True, text=True, timeout=60,
                                  env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
        assert stranger.returncode != 0 and "AuthenticationError" in stranger.stderr, stranger.stderr[-3000:]

        print(f"\nfirst actor up {time.perf_counter() - t0:.1f}s after start")
        t1 = time.perf_counter()
        node = start_worker_node(cluster.address, cluster.token_path, num_cpus=1,
                                 resources={"extra_node": 1})
        deadline = time.monotonic() + 30
        while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        join_s = time.perf_counter() - t1
        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        assert node.node_id in alive and alive[node.node_id]["NodeManagerAddress"] == "127.0.0.1"

        remote = Pinger.options(resources={"extra_node": 1}, num_cpus=0).remote()
        assert ray.get(remote.node_id.remote(), timeout=60) == node.node_id != head_node_id
        assert ray.get(pinger.node_id.remote()) == head_node_id

        # The learner's ranks reserve all their cores at once, spread over the nodes; a second
        # learner finds none left and is refused, naming what it asked for.
        learner = groups.reserve(ray, [{"CPU": 1.0}] * 2, "SPREAD", "learner", wait_s=30)
        placed = ray.util.placement_group_table(learner)["bundles_to_node_id"]
        assert set(placed.values()) == {head_node_id, node.node_id}
        with pytest.raises(ValueError, match=r"no room for learner-b: 2 x \{'CPU': 1.0\} \(SPREAD\) "
                                             r"not reserved in 1 s; its nodes have \[") as refused:
            groups.reserve(ray, [{"CPU": 1.0}] * 2, "SPREAD", "learner-b", wait_s=1)
        nodes = ast.literal_eval(str(refused.value).split("its nodes have ")[1].split(" in all")[0])
        assert sorted(nodes, key=len) == [{"CPU": 1.0}, {"CPU": 1.0, "extra_node": 1.0}]  # Ray's order varies
        groups.release(learner)

        all_pids = cluster.pids() | node.pids() | {os.getpid()}
        hosts = _listening_addresses(all_pids)
        assert hosts and hosts <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, hosts
        print(f"start {start_s:.1f}s, second driver: import+connect {second['connect_s']:.1f}s, "
              f"whole process {driver_s:.1f}s, worker join {join_s:.1f}s, RSS head "
              f"{_rss_mib(cluster.pids()):.0f} MiB ({len(cluster.pids())} processes), node "
              f"{_rss_mib(node.pids()):.0f} MiB ({len(node.pids())}), listening on {sorted(hosts)}")
    finally:
        pids = cluster.pids() | (node.pids() if node else set())
        t2 = time.perf_counter()
        try:
            ray.shutdown()
            if node:
                node.stop()
        finally:
            cluster.stop()
        print(f"stop {time.perf_counter() - t2:.1f}s")
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"]
    assert not alive, f"left running: {alive}"
    assert not cluster.temp_dir.exists()
    assert not ray_home.exists()


LAUNCHER = """
import sys
from async_rlhf.launch.cluster import start_local_cluster
cluster = start_local_cluster(num_cpus=1)
print(cluster.pid, cluster.temp_dir, flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cluster_dies_with_a_killed_launcher():
    from async_rlhf.launch.cluster import session_pids

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        head_pid, temp_dir = launcher.stdout.readline().split()
        head_pid = int(head_pid)
        assert session_pids(head_pid)
    finally:
        launcher.kill()  # SIGKILL: no atexit, no finally in the launcher
        launcher.wait()
    deadline = time.monotonic() + 30
    while session_pids(head_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_pids(head_pid), f"orphaned Ray processes: {session_pids(head_pid)}"
    shutil.rmtree(temp_dir)  # what a killed launcher leaves: the temp dir (logs) and its log
    os.unlink(temp_dir + ".log")
