"""free_port: a port the kernel will not hand to another process in the meantime."""

from __future__ import annotations

import random
import socket
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
