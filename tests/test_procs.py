"""free_port: a port the kernel will not hand to another process in the meantime. renice: a
running process's threads and children, in a subprocess of its own (priorities only go down)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from async_rlhf.procs import LOOPBACK, free_port


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


_RENICE = textwrap.dedent("""
    import os, subprocess, sys, threading
    from async_rlhf.procs import renice, threads_of

    def nice(tid):
        return os.getpriority(os.PRIO_PROCESS, tid)

    before = threading.Thread(target=threading.Event().wait, daemon=True)
    before.start()  # as a Ray worker's own threads: started before, left alone
    since = threads_of()
    started = threading.Event()
    after = threading.Thread(target=lambda: (started.set(), threading.Event().wait()), daemon=True)
    after.start()  # as the engine's threads
    started.wait()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a reward worker
    renice(5, since=since)
    print(nice(threading.get_native_id()), nice(before.native_id), nice(after.native_id), nice(child.pid))
    child.kill()
""")


def test_renice_lowers_the_threads_started_since_and_the_children_only():
    done = subprocess.run([sys.executable, "-c", _RENICE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert [int(n) for n in done.stdout.split()] == [min(19, base + 5), base, min(19, base + 5), min(19, base + 5)]
