"""Small process helpers shared by the parts that start servers or process groups."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

LOOPBACK = "127.0.0.1"

_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


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


# torch.distributed rendezvous variables: a child is a lone process or a whole job of its own,
# never a member of a group this process (or the shell, under torchrun or SLURM) set up.
_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_child(argv: list[str], log_path: Path, timeout_s: float) -> int:
    """Run a child to completion; if we are interrupted or it overruns, stop it (SIGTERM: a job
    stops its generators and Ray cleanly) before going on."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            return proc.wait(timeout_s)
        except BaseException:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
