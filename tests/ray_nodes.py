"""A second Ray node on this machine, for tests of add-generators placement and multi-node Ray:
on loopback (start_worker_node), or on a second host made of a network namespace (second_host,
start_head, start_node_in: a real second address, as a job spanning two machines sees it).

Users add a node with `ray start --address=... --resources=...` (README, "Adding generators"),
but `ray start` refuses a non-head node on a loopback-only cluster (async_rlhf/launch/cluster.py
explains why the job's local cluster is one), so this starts `ray._private.node.Node(head=False)`
itself (cluster.node_command), which is what `ray start --address` does. It reuses cluster.py's
process-session helpers (own session, parent-death signal, stop by session), private to that module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from async_rlhf.launch.cluster import (_LOOPBACK_HOSTS, LocalCluster, _Node, _spawn, _wait_for_log,
                                       node_command, ray_env)
from async_rlhf.procs import LOOPBACK, free_port

@dataclass
class WorkerNode(_Node):
    """A second raylet on this machine joined to a cluster; `node_id` is Ray's hex node id."""

    node_id: str = ""


def start_worker_node(address: str, token_path: Path, num_cpus: int,
                      resources: dict[str, float]) -> WorkerNode:
    """Join a raylet on this machine (own ports, loopback) to the cluster at `address`, whose
    token is in `token_path`."""
    host = address.rsplit(":", 1)[0]
    if host not in _LOOPBACK_HOSTS:
        raise ValueError(f"start_worker_node joins a node on this machine's loopback; got address "
                         f"{address}: use `ray start --address={address}` on the other machine")
    log_path = Path(tempfile.mkstemp(prefix="arl-ray-node-", suffix=".log", dir="/tmp")[1])
    params = dict(gcs_address=f"{LOOPBACK}:{address.rsplit(':', 1)[1]}", node_ip_address=LOOPBACK,
                  num_cpus=num_cpus, resources=resources)
    group = _spawn(node_command(params, head=False), log_path, ray_env(token_path))
    line = _wait_for_log(group, "Ray runtime started", f"ray worker node for {address}")
    return WorkerNode(group, node_id=line.split()[-1])


# ---- A second host on this machine: a network namespace joined to this one by a veth pair.
# Root only. The two ends get private addresses on a /30 of their own (10.213.x.y, from our PID),
# so traffic between the two nodes goes only over the veth we made. Leftovers of a run that was
# killed (names carry its PID) are removed first.

_NETNS_PREFIX, _VETH_PREFIX = "arlnb", "arlv"


class NetnsUnavailable(RuntimeError):
    """`ip netns` is not permitted here (not root, or no network namespaces)."""


@dataclass(frozen=True)
class HostPair:
    namespace: str  # the second host's network namespace
    head_ip: str  # this host's end of the veth
    node_ip: str  # the second host's end


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _remove_leftovers() -> None:
    names = _ip("netns", "list", check=False).stdout.split()
    links = re.findall(rf"\d+: ({_VETH_PREFIX}\d+)[@:]", _ip("-o", "link", "show", check=False).stdout)
    for name in names + links:
        match = re.fullmatch(rf"(?:{_NETNS_PREFIX}|{_VETH_PREFIX})(\d+)", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _ip(*(("netns", "del") if name in names else ("link", "del")), name, check=False)


@contextmanager
def second_host():
    """A network namespace with its own address, reachable from this one over a veth pair;
    removed (with the veth) on exit. Raises NetnsUnavailable where `ip netns` is not allowed."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    _remove_leftovers()
    pid = os.getpid()
    ns, veth, peer = f"{_NETNS_PREFIX}{pid}", f"{_VETH_PREFIX}{pid}", f"{_VETH_PREFIX}{pid}b"
    n = pid % 16384  # a /30 per PID: 10.213.(n / 64).(4 (n % 64)), ends .1 (here) and .2
    net = f"10.213.{n >> 6}."
    head_ip, node_ip = f"{net}{((n & 63) << 2) + 1}", f"{net}{((n & 63) << 2) + 2}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer, "netns", ns)
        _ip("addr", "add", f"{head_ip}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{node_ip}/30", "dev", peer)
        _ip("-n", ns, "link", "set", peer, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield HostPair(ns, head_ip, node_ip)
    finally:
        _ip("netns", "del", ns, check=False)  # takes the veth pair with it
        _ip("link", "del", veth, check=False)


def _routable_env(token_path: Path) -> dict[str, str]:
    """A Ray process's environment for a cluster that spans hosts: ray_env without the loopback
    switch and loopback-only gloo."""
    env = ray_env(token_path)
    del env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"], env["GLOO_SOCKET_IFNAME"]
    return env


def _ray_start(prefix: list[str], args: list[str], token_path: Path, what: str) -> LocalCluster:
    """`ray start ... --block` in its own session and temp dir (both go on stop())."""
    temp_dir = Path(tempfile.mkdtemp(prefix="arl-ray-", dir="/tmp"))
    cmd = [*prefix, sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
           f"--temp-dir={temp_dir}", "--disable-usage-stats", "--dashboard-agent-listen-port=0", *args]
    group = _spawn(cmd, temp_dir.with_suffix(".log"), _routable_env(token_path))
    node = LocalCluster(group, temp_dir=temp_dir)
    try:
        _wait_for_log(group, "Ray runtime started", what)
    except BaseException:
        node.stop()
        raise
    return node


def start_head(host: str, token_path: Path, num_cpus: int) -> tuple[LocalCluster, str]:
    """A Ray head node on `host` (a routable address) with the token in `token_path`;
    (node, address)."""
    port = free_port(host)
    node = _ray_start([], ["--head", f"--node-ip-address={host}", f"--port={port}",
                           f"--num-cpus={num_cpus}", "--include-dashboard=false", "--no-monitor",
                           f"--ray-client-server-port={free_port(host)}"], token_path, "ray head")
    return node, f"{host}:{port}"


def start_node_in(pair: HostPair, address: str, token_path: Path, num_cpus: int,
                  resources: dict[str, float]) -> LocalCluster:
    """A Ray worker node inside the second host's namespace, joined to the head at `address`."""
    return _ray_start([shutil.which("ip"), "netns", "exec", pair.namespace],
                      [f"--address={address}", f"--node-ip-address={pair.node_ip}",
                       f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources)}"],
                      token_path, f"ray worker node in namespace {pair.namespace}")
