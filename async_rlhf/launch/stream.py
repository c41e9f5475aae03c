"""The launcher's side of the experience stream: the staleness gate's books, read from it
(StreamBooks), and the job's own redis-server, restarted when it dies or stops answering
(alive but not replying to PING for HUNG_S: SIGSTOPped, wedged), which is killed first."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import redis

from async_rlhf.config import Config, QueueConfig, redact_url
from async_rlhf.messages import Accounting, not_trained
from async_rlhf.protocols import QueueStats
from buffer.redis_server import EmbeddedRedis
from buffer.redis_stream import RedisExperienceQueue

T = TypeVar("T")
HUNG_S = 10.0  # an embedded redis-server that answers no PING for this long is killed and restarted


def gate_accepted(stats: QueueStats, batch_size: int, group_size: int) -> int:
    """The staleness gate's `accepted` (samples) from one read of the stream: the learner has
    consumed learner_version batches (fresh or re-used samples: one batch_size per version),
    and our groups neither trained nor gone untrained (backlog and pending, less the held,
    which the learner already trained) come next. Foreign entries are in none of these counts,
    a duplicate is produced and acked, and after a learner restart the version is its
    checkpoint's and nothing is held: the formula holds across every fault."""
    c = stats.counters
    untrained = c.get("produced", 0) - c.get("trained", 0) - not_trained(c) - stats.held
    return stats.learner_version * batch_size + untrained * group_size


class StreamBooks:
    """The Coordinator's one source for its gate (picklable: connects on first use)."""

    def __init__(self, queue: QueueConfig, url: str, batch_size: int, group_size: int):
        self.cfg, self.url, self.batch_size, self.group_size = queue, url, batch_size, group_size
        self._queue: RedisExperienceQueue | None = None

    def read(self) -> tuple[int, int]:
        """(the learner's version, the gate's accepted samples), read in one transaction."""
        if self._queue is None:
            self._queue = RedisExperienceQueue.from_config(self.cfg, self.url, consumer="coordinator")
        stats = self._queue.stats()
        return stats.learner_version, gate_accepted(stats, self.batch_size, self.group_size)


class JobStream:
    """`server`: the embedded redis-server at `url`, or None for queue.redis_url (not ours to
    restart). Counts are of groups unless named samples."""

    def __init__(self, cfg: Config, url: str, server: EmbeddedRedis | None):
        self.cfg, self.url, self.server = cfg, url, server
        # the embedded server is ours to restart (stats): do not wait a minute for it
        self.queue = RedisExperienceQueue.from_config(cfg.queue, url, consumer="driver",
                                                      retries=35 if server is None else 3,
                                                      socket_timeout=None if server is None else HUNG_S)
        self.left_in_queue = 0  # as of the last read
        self.last_stats: QueueStats | None = None  # refresh's
        self.restarts = 0  # of the redis-server

    def check_fresh(self, resume: bool) -> None:
        """A new job must not train on (or count) another run's groups."""
        stats = self.queue.stats()
        produced = stats.counters.get("produced", 0)
        if produced and not resume:
            raise SystemExit(
                f"the experience stream {self.cfg.queue.stream!r} at {redact_url(self.url)} already "
                f"holds {produced} groups from an earlier run: pass --resume to continue it, or set "
                "queue.stream=<new name> (or use a fresh --out with the embedded Redis)")

    def refresh(self) -> None:
        """Read the stream's stats (each tick does, once), restarting the job's own
        redis-server first if it died or stopped answering."""
        self.last_stats = stats = self.stats()
        self.left_in_queue = stats.backlog + stats.pending

    def stats(self) -> QueueStats:
        return self._read(self.queue.stats)

    def accounting(self) -> Accounting:
        """From the stats the last refresh read."""
        return self._read(lambda: self.queue.accounting(self.last_stats))

    def _read(self, read: Callable[[], T]) -> T:
        """A read of the stream; the job's own redis-server, found dead or not answering before
        or during the call, is restarted first (our client gives up on it at once, the others
        ride it out: killing a stopped server resets their connections)."""
        if (why := self._server_trouble()) is not None:
            self._restart_server(why)
        try:
            return read()
        except (redis.ConnectionError, redis.TimeoutError):
            if (why := self._server_trouble()) is None:
                raise
            self._restart_server(why)
            return read()

    def _server_trouble(self) -> str | None:
        """Why the job's own redis-server needs a restart ("died", "stopped answering"), or None."""
        if self.server is None:
            return None
        if not self.server.running:
            return "died"
        if not self.server.answers(HUNG_S):
            if self.server.exits_within(2.0):  # refused: it was dying already (a crash, a SIGKILL)
                return "died"
            self.server.kill()
            return f"stopped answering (no reply to PING in {HUNG_S:.0f} s; killed it)"
        return None

    def _restart_server(self, why: str) -> None:
        """The embedded redis-server died: start it again on its port and data directory. The
        queue's clients retry meanwhile. With queue.durable its append-only file brings the
        stream back, pending entries and counters included; without it they are gone, and the
        job ends saying so (after the restart, so that the learner can still checkpoint).
        `why`: what happened to it, for the message."""
        self.restarts += 1
        self.server.start()
        if not self.cfg.queue.durable:
            raise RuntimeError(
                f"redis-server {why} and queue.durable is false: the experience stream, its "
                f"counters and dead letters are gone ({self.left_in_queue} groups were in it at the "
                "last step); set queue.durable=true to ride out a Redis restart")
        print(f"redis-server {why}; restarted it on port {self.server.port} from its append-only "
              f"file (restart {self.restarts})", file=sys.stderr)
