"""A second Ray node on this machine, for tests of add-generators placement and multi-node Ray.

Users add a node with `ray start --address=... --resources=...` (README, "Adding generators"),
but `ray start` refuses a non-head node on a loopback-only cluster (async_rlhf/launch/cluster.py
explains why the job's local cluster is one), so this starts `ray._private.node.Node(head=False)`
itself, which is what `ray start --address` does. It reuses cluster.py's process-session helpers
(own session, parent-death signal, stop by session), private to that module.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from async_rlhf.launch.cluster import _LOOPBACK_HOSTS, _Node, _spawn, _wait_for_log
from async_rlhf.procs import LOOPBACK

_WORKER_NODE_MAIN = """
import json, signal, sys
from ray._private.node import Node
from ray._private.parameter import RayParams
address, num_cpus, resources = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
params = RayParams(gcs_address=address, node_ip_address="127.0.0.1", num_cpus=num_cpus,
                   resources=resources, dashboard_agent_listen_port=0)
node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
print("WORKER_NODE_READY", node.node_id, flush=True)
while True:
    signal.pause()  # Node's SIGTERM handler shuts the node's processes down and exits
"""


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
    cmd = [sys.executable, "-c", _WORKER_NODE_MAIN, f"{LOOPBACK}:{address.rsplit(':', 1)[1]}",
           str(num_cpus), json.dumps(resources)]
    group = _spawn(cmd, log_path, token_path)
    line = _wait_for_log(group, "WORKER_NODE_READY", f"ray worker node for {address}")
    return WorkerNode(group, node_id=line.split()[-1])
