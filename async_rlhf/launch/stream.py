"""The launcher's side of the experience stream: its counters read for the staleness gate
(groups gone untrained give their gate slots back; a (re)started learner rebases the gate on
what the stream holds), and the job's own redis-server, restarted when it dies or stops
answering (alive but not replying to PING for HUNG_S: SIGSTOPped, wedged), which is killed
first."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import redis

from async_rlhf.config import Config, redact_url
from async_rlhf.messages import Accounting, not_trained
from async_rlhf.protocols import QueueStats
from buffer.redis_server import EmbeddedRedis
from buffer.redis_stream import RedisExperienceQueue

T = TypeVar("T")
HUNG_S = 10.0  # an embedded redis-server that answers no PING for this long is killed and restarted


class JobStream:
    """`server`: the embedded redis-server at `url`, or None for queue.redis_url (not ours to
    restart). Counts are of groups unless named samples."""

    def __init__(self, cfg: Config, url: str, server: EmbeddedRedis | None):
        self.cfg, self.url, self.server = cfg, url, server
        # the embedded server is ours to restart (stats): do not wait a minute for it
        self.queue = RedisExperienceQueue.from_config(cfg.queue, url, consumer="driver",
                                                      retries=35 if server is None else 3,
                                                      socket_timeout=None if server is None else HUNG_S)
        self.forgotten = 0  # groups gone untrained whose gate slots were already returned
        self.left_in_queue = 0  # as of the last read
        self.last_stats: QueueStats | None = None  # newly_gone's
        self.restarts = 0  # of the redis-server

    def check_fresh(self, resume: bool) -> int:
        """A new job must not train on (or count) another run's groups. Returns the samples
        the stream holds, which a resumed job counts into its gate (see Coordinator)."""
        stats = self.queue.stats()
        produced = stats.counters.get("produced", 0)
        if produced and not resume:
            raise SystemExit(
                f"the experience stream {self.cfg.queue.stream!r} at {redact_url(self.url)} already "
                f"holds {produced} groups from an earlier run: pass --resume to continue it, or set "
                "queue.stream=<new name> (or use a fresh --out with the embedded Redis)")
        return self.rebase(stats)

    def rebase(self, stats: QueueStats | None = None) -> int:
        """Count what is gone untrained as accounted for; returns the samples in the stream
        (backlog and pending: whole groups of generator.group_size)."""
        stats = self.stats() if stats is None else stats
        self.forgotten = not_trained(stats.counters)
        return (stats.backlog + stats.pending) * self.cfg.generator.group_size

    def newly_gone(self) -> int:
        """Samples of the groups gone untrained (stale, malformed, dead-lettered) since the last
        call: their gate slots go back."""
        self.last_stats = stats = self.stats()
        self.left_in_queue = stats.backlog + stats.pending
        gone, before = not_trained(stats.counters), self.forgotten
        self.forgotten = max(gone, before)
        return max(gone - before, 0) * self.cfg.generator.group_size

    def stats(self) -> QueueStats:
        return self._read(self.queue.stats)

    def accounting(self) -> Accounting:
        """From the stats the last newly_gone read (each tick reads them once)."""
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
