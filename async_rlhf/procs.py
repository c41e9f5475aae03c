"""Small process helpers shared by the parts that start servers or process groups."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

LOOPBACK = "127.0.0.1"
# Ray runs its workers at nice 15 (RAY_worker_niceness), the learner ranks' priority, which
# placement's CPU shares assume. The job's own cluster starts them at STARTUP_NICE: the engines'
# start is the job's critical path, and until they are up they get a core before the learner
# ranks do; each role lowers itself to WORKER_NICE once its part of the start is done (roles.py).
WORKER_NICE, STARTUP_NICE = 15, 10

_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` (default: the loopback interface) right now, drawn from below
    the kernel's ephemeral range. A port the kernel hands out for bind(0) or connect() may go to any process
    between this call and the server's bind (seen: Ray's client server lost its port so, 3 s
    after the head started, and the head went down with it); a port below that range is only
    taken by a process that asks for it by number. Where the range starts too low for that, the
    kernel picks."""
    low = _ephemeral_start()
    if low - _PORT_FLOOR > 1000:
        for _ in range(100):
            port = _rng.randrange(_PORT_FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:  # in use
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Below: well-known service ports, and Ray's worker ports (`ray start --min-worker-port`
# 10002 to --max-worker-port 19999), which Ray binds by number and refuses for its other parts.
_PORT_FLOOR = 20000
_rng = random.SystemRandom()  # not the random module's: processes that seed it alike would collide


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def interface_of(address: str) -> str:
    """The name of this machine's network interface that holds `address` (for
    GLOO_SOCKET_IFNAME: gloo otherwise binds the address the hostname resolves to, which may be
    loopback, 127.0.0.1 here, and unreachable from other nodes)."""
    import psutil  # a dependency of DeepSpeed and vLLM

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    raise ValueError(f"no network interface of this machine has the address {address}: "
                     "start this node's Ray with --node-ip-address set to one of its own")


def die_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` wrapped so that it gets SIGTERM when this process dies, even by SIGKILL (Linux's
    parent-death signal, set in a tiny trampoline: preexec_fn is unsafe once threads exist).
    `cmd[0]` must be a path."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc): how long a user has waited since the
    command, imports included."""
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")


# A secret the learner ranks' rendezvous store prefixes its keys with, so that only the ranks the
# launcher started join (the store listens on every interface of rank 0's node).
RENDEZVOUS_KEY = "ASYNC_RLHF_RENDEZVOUS_KEY"
# torch.distributed rendezvous variables: a child is a lone process or a whole job of its own,
# never a member of a group this process (or the shell, under torchrun or SLURM) set up.
_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", RENDEZVOUS_KEY)


def run_child(argv: list[str], log_path: Path, timeout_s: float,
              stop: threading.Event | None = None) -> int:
    """Run a child to completion; its exit code. If we are interrupted, it overruns or `stop` is
    set (from another thread: a child run by a worker thread), stop it first (SIGTERM: a job
    stops its generators and Ray cleanly); `stop` then makes it return the child's code."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    deadline = time.monotonic() + timeout_s
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while not (stop is not None and stop.is_set()):
                try:
                    return proc.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        raise
            _terminate(proc)
            return proc.returncode
        except BaseException:
            _terminate(proc)
            raise


def _terminate(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the main thread, so a command stops as
    Ctrl-C stops it, cleanly (SIGINT too when a shell started us in the background, with SIGINT
    ignored). Call it after ray.init, which installs handlers of its own."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def threads_of(pid: int | str = "self") -> set[int]:
    """The thread ids of a process (Linux: /proc/PID/task); empty if it is gone."""
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after its name: state, ppid, pgrp, session, ...) of
    every process (Linux)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            yield int(entry), stat[stat.rindex(")") + 2:].split()  # the name may hold spaces


def descendants(pid: int) -> list[int]:
    """The processes below `pid`: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for child, fields in proc_stats():
        children.setdefault(int(fields[1]), []).append(child)
    out, todo = [], [pid]
    while todo:
        out.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    return out


def lower_priority(nice: int, since: set[int] | None = None) -> None:
    """Lower threads of this process, and every thread of the processes below it, to the nice
    value `nice` (at most 19; a thread already at a lower priority keeps it): the calling thread
    and those started after `since` (threads_of() then); or, without `since`, every thread at
    STARTUP_NICE or below in priority, which leaves a Ray worker's RPC threads alone (they run at
    the raylet's priority, above its workers'). Linux keeps priorities per thread (os.nice reaches
    only the calling one), and an unprivileged process cannot raise one back."""
    nice = min(19, nice)
    targets = threads_of() if since is None else (threads_of() - since) | {threading.get_native_id()}
    for child in descendants(os.getpid()):
        targets |= threads_of(child)
    for tid in targets:
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            if now < nice and (since is not None or now >= STARTUP_NICE):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # gone meanwhile
            pass


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


# free heap worth handing back: what a large model's step or weight load frees (3 GiB on a 0.5B
# model's learner rank), not what a small one's does, whose next step would only fault it back
# in (malloc_trim after every step cost the small preset's learner 7% of its samples/s)
RETURN_FREED_BYTES = 1 << 30


def return_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS when RETURN_FREED_BYTES or more sit free
    (glibc's mallinfo2 and malloc_trim; elsewhere nothing). glibc keeps what a process frees for
    its own reuse, in the heap of the thread that freed it: a weight update's or a learner
    step's thousands of tensors, each under its mmap threshold, leave their size behind
    (measured on a 0.5B model: ~0.8 GiB per update in a bf16 engine, ~3 GiB per learner step)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None)
    try:
        libc.mallinfo2.restype = _MallInfo2
        if libc.mallinfo2().fordblks >= RETURN_FREED_BYTES:
            libc.malloc_trim(0)
    except AttributeError:  # not glibc >= 2.33 (musl, older glibc)
        pass
