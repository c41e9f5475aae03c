"""free_port: a port the kernel will not hand to another process in the meantime. lower_priority:
a running process's threads and children, in a subprocess of its own (priorities only go down)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from async_rlhf.procs import LOOPBACK, STARTUP_NICE, WORKER_NICE, free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(50):
        port = free_port()
        assert 20000 <= port < start  # bind(0) and connect() draw only from [start, end]; under
        # 20000 are Ray's worker ports (it refuses a head whose client-server port is one)
        with socket.socket() as s:
            s.bind((LOOPBACK, port))


def test_free_port_leaves_the_random_module_alone():
    # processes that seed `random` alike (as trainers do) must not draw the same ports
    random.seed(0)
    expected = random.random()
    random.seed(0)
    free_port()
    assert random.random() == expected


_LOWER = textwrap.dedent("""
    import os, subprocess, sys, threading
    from async_rlhf.procs import STARTUP_NICE, WORKER_NICE, lower_priority, threads_of

    def nice(tid):
        return os.getpriority(os.PRIO_PROCESS, tid)

    def thread(nice=None):
        started = threading.Event()
        def run():
            if nice is not None:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            started.set()
            threading.Event().wait()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        started.wait()
        return t

    # as a Ray worker: RPC threads at the raylet's priority, then the rest at its workers' nice
    rpc = thread()
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STARTUP_NICE)
    before = thread()  # as Ray's other threads: started before `since`
    since = threads_of()
    after, low = thread(), thread(nice=19)  # as the engine's threads, one already at 19
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a reward worker
    lower_priority(WORKER_NICE, since=since)
    print(*[nice(t) for t in (threading.get_native_id(), before.native_id, after.native_id,
                              low.native_id, child.pid, rpc.native_id)])
    lower_priority(WORKER_NICE + 2)  # every thread, bar the RPC ones
    print(*[nice(t) for t in (threading.get_native_id(), before.native_id, after.native_id,
                              low.native_id, child.pid, rpc.native_id)])
    child.kill()
""")


def test_lower_priority_reaches_the_threads_started_since_and_the_children_never_raising_one():
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the RPC threads' (the raylet's) priority
    if base >= STARTUP_NICE:
        pytest.skip(f"runs at nice {base}: a Ray worker's RPC threads would too")
    done = subprocess.run([sys.executable, "-c", _LOWER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    since, every = [[int(n) for n in line.split()] for line in done.stdout.splitlines()]
    assert since == [WORKER_NICE, STARTUP_NICE, WORKER_NICE, 19, WORKER_NICE, base]
    assert every == [WORKER_NICE + 2] * 3 + [19, WORKER_NICE + 2, base]
