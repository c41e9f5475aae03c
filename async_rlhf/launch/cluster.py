"""A Ray cluster bound to loopback, second drivers, and a registry of running jobs.

`async-rlhf train` starts a local cluster (or connects to one by address) and records the job;
`async-rlhf status|stop|add-generators --job NAME` read that record from other processes and
connect as second drivers to the job's namespace.

How Ray is kept on 127.0.0.1 (Ray 2.60; read from ray/_private/services.py):
- Ray rewrites every loopback host it is given ("127.0.0.1", "localhost") into the machine's
  routable address (`resolve_ip_for_localhost`), for `--node-ip-address`, `_node_ip_address` and
  the address a driver connects to, unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`: then the node
  address is the loopback one. Every Ray process we start gets that variable, and `connect` sets
  it for its own process when the address is on loopback. With it, the GCS, raylet, Ray client
  server and agents all listen on 127.0.0.1 only.
- `ray start` refuses to start a non-head node under that variable, so a second node on this
  machine (the tests' tests/ray_nodes.py) runs `ray._private.node.Node(head=False)` itself, which
  is what `ray start --address` does.
- Token auth: a local cluster gets a token of its own, made at start (`secrets.token_hex(32)`,
  as Ray makes them) in a 0600 file inside its 0700 temp dir; every process of the cluster, and
  every driver that connects with `token_path`, gets `RAY_AUTH_MODE=token` and
  `RAY_AUTH_TOKEN_PATH` pointing at it. Nothing is read from or written to `~/.ray` (`ray start`
  would not create `~/.ray/auth_token`: only `ray.init()` does), and another user's job cannot
  connect to ours. The job registry records the path for second drivers. A cluster we did not
  start (`--ray-address`) keeps its own auth settings: `connect` then sets nothing.

Processes are started in their own session (`start_new_session`), get SIGTERM if the process
that started them dies (PR_SET_PDEATHSIG), and are stopped by session: SIGTERM to the leader
(Ray's own shutdown), then SIGKILL to whatever is left in the session.
Never `ray stop`: it kills every Ray process on the machine.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from async_rlhf.procs import LOOPBACK, STARTUP_NICE, die_with_parent, free_port, proc_stats

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 15.0
_TOKEN_FILE = "auth_token"
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _use_token(env: dict[str, str] | os._Environ, token_path: Path) -> None:
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    env.pop("RAY_AUTH_TOKEN", None)  # Ray reads it before the path


def ray_env(token_path: Path) -> dict[str, str]:
    """The environment a Ray process of a local cluster needs (see module docstring)."""
    env = dict(os.environ)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    _use_token(env, token_path)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # On SIGTERM a node first waits up to 30 s for a drain meant for Ray Serve on Kubernetes
    # (it hung the whole 30 s with a detached actor alive); nothing here needs it.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    # gloo groups that bind no address of their own (vLLM's) otherwise take the hostname's
    # interface; the learner ranks and the weight broadcast bind their node's address
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["RAY_worker_niceness"] = str(STARTUP_NICE)  # each role lowers itself once it is up
    return env


def session_pids(sid: int) -> set[int]:
    """PIDs of the live (non-zombie) processes in session `sid`.

    Sessions, not process groups: the raylet puts each worker in a process group of its own.
    """
    return {pid for pid, fields in proc_stats() if fields[0] != "Z" and int(fields[3]) == sid}


@dataclass
class _ProcessSession:
    """A process started as the leader of its own session, with everything it spawns."""

    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pids(self) -> set[int]:
        return session_pids(self.proc.pid)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """SIGTERM the leader (Ray shuts its children down), then SIGKILL what is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.pids():
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            while self.pids() and time.monotonic() < deadline + 5:
                time.sleep(0.1)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        left = self.pids()
        if left:
            raise RuntimeError(f"processes {sorted(left)} of session {self.proc.pid} outlived stop()")
        self.log_path.unlink(missing_ok=True)


# Run first in the child, then exec the real command: SIGTERM on the death of the thread that
# started it (PR_SET_PDEATHSIG survives exec). Not a preexec_fn: the driver has threads by then.
def _spawn(cmd: list[str], log_path: Path, env: dict[str, str]) -> _ProcessSession:
    # Own session so stop() finds every descendant; parent-death signal so a launcher that is
    # SIGKILLed does not leave an orphaned cluster behind.
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            die_with_parent(cmd), env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return _ProcessSession(proc, log_path)


def _wait_for_log(group: _ProcessSession, marker: str, what: str) -> str:
    """Wait until `marker` appears in the group's log; return the line holding it."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in group.log_path.read_text(errors="replace").splitlines():
            if marker in line:
                return line
        if group.proc.poll() is not None:
            tail = group.log_tail()
            group.stop()
            raise RuntimeError(f"{what} exited with code {group.proc.returncode} before it was "
                               f"ready; last lines of its log:\n{tail}")
        time.sleep(0.2)
    tail = group.log_tail()
    group.stop()
    raise TimeoutError(f"{what} not ready after {_START_TIMEOUT_S:.0f} s; last lines of its log:\n"
                       f"{tail}")


@dataclass
class _Node:
    """Ray processes started by this process in their own session; stopped all together."""

    _group: _ProcessSession = field(repr=False)

    @property
    def pid(self) -> int:
        return self._group.pid

    def pids(self) -> set[int]:
        """Every live process of the node (GCS, raylet, agents, workers, actors)."""
        return self._group.pids()

    def stop(self) -> None:
        self._group.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class LocalCluster(_Node):
    """A Ray head node on 127.0.0.1 started by this process; `address` and `token_path` are
    what drivers use (`connect`)."""

    address: str = ""
    temp_dir: Path = Path()

    @property
    def token_path(self) -> Path:
        return self.temp_dir / _TOKEN_FILE

    def wait_ready(self) -> LocalCluster:
        """Wait until the head is up; if it cannot start, stop what is left and raise with the
        last lines of its log."""
        try:
            _wait_for_log(self._group, "Ray runtime started", "ray head node")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_local_cluster(num_cpus: int, resources: dict[str, float] | None = None) -> LocalCluster:
    """Start a Ray head node listening on 127.0.0.1 only, with its own temp dir and ports, and
    wait until it is up."""
    return launch_local_cluster(num_cpus, resources).wait_ready()


def launch_local_cluster(num_cpus: int, resources: dict[str, float] | None = None) -> LocalCluster:
    """Start a Ray head node as start_local_cluster does, without waiting for it: other work can
    go on meanwhile, then `wait_ready()`. Call both from the same thread (the head gets SIGTERM
    when the thread that started it ends: PR_SET_PDEATHSIG)."""
    if num_cpus < 1:
        raise ValueError(f"num_cpus must be >= 1, got {num_cpus}")
    # Unix socket paths must stay under 108 bytes: keep the temp dir short and in /tmp.
    temp_dir = Path(tempfile.mkdtemp(prefix="arl-ray-", dir="/tmp"))  # mode 0700
    token_path = temp_dir / _TOKEN_FILE
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    port = free_port()
    # Defaults are fixed ports (52365 for the agent): a second cluster on the machine would clash.
    # No autoscaler monitor (the cluster is fixed) and no dashboard.
    params = dict(node_ip_address=LOOPBACK, node_name=LOOPBACK, gcs_server_port=port,
                  num_cpus=num_cpus, resources=resources or {}, temp_dir=str(temp_dir),
                  include_dashboard=False, no_monitor=True)
    group = _spawn(node_command(params, head=True), temp_dir.with_suffix(".log"), ray_env(token_path))
    return LocalCluster(group, address=f"{LOOPBACK}:{port}", temp_dir=temp_dir)


# What `ray start [--head] --block` runs, without its CLI: that imports ~1.5 CPU-s of modules
# (click, the autoscaler) while the job waits on the head, and it adds a Ray client server
# (ray:// drivers; every driver here connects to the GCS).
_NODE_MAIN = """
import json, signal, sys
from ray._private.node import Node
from ray._private.parameter import RayParams
head, params = sys.argv[1] == "head", json.loads(sys.argv[2])
node = Node(RayParams(dashboard_agent_listen_port=0, **params), head=head, shutdown_at_exit=True,
            spawn_reaper=True)
print("Ray runtime started", node.node_id, flush=True)
while True:
    signal.pause()  # Node's SIGTERM handler shuts the node's processes down and exits
"""


def node_command(params: dict, head: bool) -> list[str]:
    """The command line of a Ray node process with these RayParams (JSON values); its log says
    "Ray runtime started <node id>" once the node is up."""
    return [sys.executable, "-c", _NODE_MAIN, "head" if head else "worker", json.dumps(params)]


def connect(address: str | None, namespace: str, token_path: Path | str | None = None, **init_kwargs):
    """Connect this process to a running cluster as a driver in `namespace`; returns ray's context.

    `address` is "host:port" of the GCS (`LocalCluster.address`, or the one in the job's record);
    None uses $RAY_ADDRESS. `token_path`: the token file of a cluster we started (None: the
    cluster's own auth settings, from this process's environment). For a loopback address this
    sets the loopback switch (see module docstring) in this process, even when ray is already
    imported.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError("no Ray address: pass one (host:port) or set RAY_ADDRESS; a running job's "
                         "address is in its record: `async-rlhf status --job NAME`")
    ray_was_imported = "ray._raylet" in sys.modules
    loopback = address.rsplit(":", 1)[0] in _LOOPBACK_HOSTS
    if token_path is not None:
        _use_token(os.environ, Path(token_path))
    if loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if ray_was_imported:  # both switches are read once, at import: refresh them as Ray does
        from ray._private import ray_constants
        from ray._raylet import AuthenticationTokenLoader, Config

        if loopback:
            ray_constants.ENABLE_RAY_CLUSTER = False
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()  # a new cluster, maybe a new token

    init_kwargs.setdefault("logging_level", "WARNING")
    return ray.init(address=address, namespace=namespace, **init_kwargs)


# ---- Job registry: per running job, 0600 files that other terminals read instead of joining
# its Ray cluster: <job>.json (how to reach it), <job>.status.json (the launcher's snapshot,
# each second) and <job>.stop (a stop request, which the launcher reads after each step).


class JobNotFoundError(LookupError):
    pass


def jobs_dir() -> Path:
    """$ASYNC_RLHF_HOME/jobs, default ~/.async-rlhf/jobs."""
    home = os.environ.get("ASYNC_RLHF_HOME") or "~/.async-rlhf"
    return Path(home).expanduser() / "jobs"


def _job_path(job: str, suffix: str = ".json") -> Path:
    if not _JOB_NAME.match(job):
        raise ValueError(f"job name must match {_JOB_NAME.pattern} (letters, digits, . _ -), "
                         f"got {job!r}")
    return jobs_dir() / f"{job}{suffix}"


def _write_private(path: Path, text: str) -> Path:
    """Atomically, mode 0600 (the registry holds the Redis password)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def write_job_info(job: str, info: dict) -> Path:
    """Record a running job (ray address, redis url, out dir, launcher pid...); a status or
    stop request left by an earlier job of this name goes."""
    for suffix in (".status.json", ".stop"):
        _job_path(job, suffix).unlink(missing_ok=True)
    return _write_private(_job_path(job), json.dumps({"job": job, **info}, indent=2, sort_keys=True))


def read_job_info(job: str) -> dict:
    path = _job_path(job)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise JobNotFoundError(
            f"no running job named {job!r} (no {path}): start one with "
            f"`async-rlhf train --job {job}`"
        ) from None


def write_job_status(job: str, status: dict) -> None:
    _write_private(_job_path(job, ".status.json"), json.dumps(status))


def read_job_status(job: str) -> dict | None:
    """The launcher's latest snapshot; None before its first (the job is starting)."""
    try:
        return json.loads(_job_path(job, ".status.json").read_text())
    except FileNotFoundError:
        return None


def request_stop(job: str, reason: str) -> None:
    _write_private(_job_path(job, ".stop"), reason)


def stop_request(job: str) -> str:
    """The reason of a pending stop request, or ''."""
    try:
        return _job_path(job, ".stop").read_text() or "stop requested"
    except FileNotFoundError:
        return ""


def remove_job_info(job: str) -> None:
    for suffix in (".json", ".status.json", ".stop"):
        _job_path(job, suffix).unlink(missing_ok=True)
