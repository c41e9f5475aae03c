"""The experience queue on a Redis Stream with one consumer group (implements ExperienceQueue).

The unit is the stream entry, and an entry holds one whole GRPO group (`types.Group`: the n
scored samples of one prompt). Everything below (put chunks, the backlog bound, acks,
reclaims, dead letters, every counter) counts entries, i.e. groups, never samples, and acts on
a group as a whole: a group is never split between consumers, steps or fates.

Keys, for stream name S:
    S             the stream; per entry b"t" holding `codec.encode(group)`, b"p" the producer's
                  name and b"m" the stream's marker
    S:marker      a random token made once per stream, which only our put script writes into
                  entries: an entry without it is foreign (another client's), whatever else it
                  carries, and is dead-lettered at first delivery, never trained
    S:dead        the dead-letter stream: raw bytes, reason, detail, original id, consumer
    S:counters    a hash of counts of entries (groups) shared by every process: produced,
                  trained, dropped_stale, dead_lettered, ... (every `ack` reason), which always
                  satisfy produced = sum of ack reasons + dead_lettered + backlog + pending;
                  plus events that are not fates: reclaimed, ack_lost, set_aside[:reason], and
                  foreign: entries first delivered without the stream's marker (b"m"), i.e.
                  written by another client; their one fate is dead_lettered_foreign
    S:held        the entries the learner trained whose update no checkpoint holds yet (`hold`;
                  pending until their `ack` as trained, which removes them here)
    S:learner_version  the learner's version, written with the held set (`hold`); with the
                  counters it is all the staleness gate needs (launch/stream.py)
    S:prompt_positions  producer name -> prompts it had taken at its last put (`put` writes it
                  with the groups, atomically), where a restarted producer continues
    S:put_seq     producer name -> the number of its last put chunk applied: a chunk retried
                  after its reply was lost is not appended again
    S:group_ids   group id -> the first entry that carried it, for the newest GROUP_IDS_KEPT
                  ids (S:group_order lists them, newest first): a later entry with the same
                  group id is a copy, which the learner acks as `duplicate` (see `duplicates`)

Lifecycle of an entry: `put` XADDs it; `get` delivers it to one consumer (XREADGROUP, or
XAUTOCLAIM once it has been idle for claim_idle_ms in the hands of another consumer, presumed
dead, or at once when a previous incarnation of this consumer's name held it: a restarted
learner takes back what it had); `ack(ids, reason)` removes it (XACK + XDEL, so memory stays bounded) and counts the
reason. Entries that do not decode or validate, that a consumer `reject`s (the learner: a token
outside its vocabulary, say), or that were delivered more than max_deliveries times without an
ack (a poison entry that crashes every consumer) go to S:dead with their bytes, acked and
counted `dead_lettered` in one atomic step (a Lua script, which also checks ownership as below).
Nothing is ever trimmed from S: producers wait instead (backpressure). Because every ack also
deletes, XLEN(S) = undelivered + pending, so backlog = XLEN - pending works on Redis 6.2 and 7
alike; consumers of S must all use this class (a bare XACK without XDEL would count as backlog
forever).

Delivery guarantee. Delivery is at-least-once: an entry whose consumer dies (or stalls past
claim_idle_ms) is delivered again to another. Acknowledgement is exactly-once: `ack`,
`renew` and dead-lettering act only on entries this consumer still owns (checked atomically in
a Lua script against the pending-entries list), so an entry reclaimed by B is never acked or
counted by the stalled A; A's late ack is counted as `ack_lost` instead. Training is
exactly-once if the learner calls `renew(ids)` just before its optimizer step, trains only on
the ids it returns, and acks them within claim_idle_ms of that call: `renew` resets their idle
time, so nobody can reclaim them meanwhile. A consumer name must be unique to one live process.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from async_rlhf.config import QueueConfig
from async_rlhf.messages import Accounting
from async_rlhf.protocols import QueueStats
from async_rlhf.types import Group, Received, TrajectoryError
from buffer import redis_scripts
from buffer.codec import decode_batch, encode

log = logging.getLogger(__name__)

FIELD = b"t"
PRODUCER = b"p"  # the name of the producer that put the entry
MARK = b"m"  # the stream's marker (S:marker): only our put script writes it
_SCRIPT_CHUNK = 1000  # ids per Lua call: keeps unpack() far below Lua's stack limit
# Group ids remembered to find copies: a copy comes from a producer that put a group twice, soon
# after the first; 100k ids take ~10 MB of the server's memory.
GROUP_IDS_KEPT = 100_000


class QueueFull(TimeoutError):
    pass


@dataclass(frozen=True)
class DeadLetter:
    """An entry set aside because it could not be trained on."""

    dead_id: str  # id in the dead-letter stream
    original_id: str  # id it had in the experience stream
    reason: str  # TrajectoryError.reason: garbage, schema, non_finite_reward, ...
    detail: str
    consumer: str  # who found it
    raw: bytes  # the entry's bytes as produced (re-encoded from the group for a `reject`)


def _chunks(items: Sequence, size: int) -> Iterable[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class RedisExperienceQueue:
    """ExperienceQueue on a Redis Stream; one object per process and consumer name.

    put: chunks of pipelined XADDs (one entry per group), each in one MULTI/EXEC with the
    `produced` count, each waiting while the undelivered backlog (max_backlog entries, i.e.
    groups) leaves no room for it. get: reclaims entries idle >
    claim_idle_ms first (including this consumer name's own, left by a previous incarnation
    that crashed), then reads new ones; entries that fail to decode are dead-lettered, never
    returned. ack / renew: see the module docstring.
    """

    def __init__(
        self,
        client: redis.Redis,
        consumer: str,
        *,
        stream: str = "experience",
        group: str = "learners",
        max_backlog: int = 4096,
        claim_idle_ms: int = 30_000,
        max_deliveries: int = 3,
        dead_letter_maxlen: int = 10_000,
        put_chunk: int = 512,
    ):
        if client.get_encoder().decode_responses:
            raise ValueError("RedisExperienceQueue needs a client with decode_responses=False")
        if min(max_backlog, claim_idle_ms, max_deliveries, put_chunk) <= 0:
            raise ValueError(
                f"max_backlog ({max_backlog}), claim_idle_ms ({claim_idle_ms}), max_deliveries "
                f"({max_deliveries}) and put_chunk ({put_chunk}) must be > 0"
            )
        if not consumer:
            raise ValueError("consumer must be a non-empty name unique to this process")
        self._r = client
        self.consumer = consumer
        self.stream, self.group = stream, group
        self.dead_stream, self.counters_key = f"{stream}:dead", f"{stream}:counters"
        self.positions_key, self.put_seq_key = f"{stream}:prompt_positions", f"{stream}:put_seq"
        self.group_ids_key, self.group_order_key = f"{stream}:group_ids", f"{stream}:group_order"
        self.held_key, self.version_key = f"{stream}:held", f"{stream}:learner_version"
        self.marker_key = f"{stream}:marker"
        self.max_backlog, self.claim_idle_ms = max_backlog, claim_idle_ms
        self.max_deliveries = max_deliveries
        self.dead_letter_maxlen, self.put_chunk = dead_letter_maxlen, put_chunk
        self._ack_script = client.register_script(redis_scripts.ACK)
        self._renew_script = client.register_script(redis_scripts.RENEW)
        self._dead_script = client.register_script(redis_scripts.DEAD_LETTER)
        self._autoclaim_script = client.register_script(redis_scripts.AUTOCLAIM_IDS)
        self._put_script = client.register_script(redis_scripts.PUT)
        self._copies_script = client.register_script(redis_scripts.COPIES)
        self._hold_script = client.register_script(redis_scripts.HOLD)
        self._put_seq: int | None = None  # the number of this producer's last put chunk
        self._claim_cursor = b"0-0"
        self._held: set[str] = set()  # delivered to this consumer, not yet acked
        self._recovering = True  # until _recover_own finds nothing a predecessor left
        self._recover_after = "-"  # _recover_own's page: the stream id it goes on after
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        client.set(self.marker_key, secrets.token_hex(16), nx=True)
        self._marker = client.get(self.marker_key)
        self._backlog_seen = self._backlog()  # undelivered entries, as measured after a put

    @classmethod
    def from_config(cls, cfg: QueueConfig, url: str, consumer: str, *, retries: int = 35,
                    socket_timeout: float | None = None) -> RedisExperienceQueue:
        """`url`: cfg.redis_url, or the embedded server's url when that is None. The client
        rides out a Redis restart: a command that cannot reach the server is retried with
        backoff (50 ms doubling to 2 s), by default for about a minute before it raises (the
        process that restarts the server itself should not wait: give it few `retries`, and a
        `socket_timeout`, so that a server that stops answering cannot hold it forever)."""
        client = redis.Redis.from_url(url, decode_responses=False, socket_timeout=socket_timeout,
                                      retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries))
        return cls(
            client, consumer, stream=cfg.stream,
            group=cfg.group, max_backlog=cfg.max_backlog, claim_idle_ms=cfg.claim_idle_ms,
            max_deliveries=cfg.max_deliveries,
        )

    # -- producer side ---------------------------------------------------------------------

    def _backlog(self) -> int:
        pipe = self._r.pipeline(transaction=False)
        pipe.xlen(self.stream)
        pipe.xpending(self.stream, self.group)
        length, pending = pipe.execute()
        return length - pending["pending"]

    def _wait_for_room(self, n: int, timeout_s: float | None, start: float) -> None:
        """Wait until the undelivered backlog leaves room for n more (polling, quietly at
        first, with a warning every minute); raise QueueFull after timeout_s."""
        limit = max(self.max_backlog - n, 0)
        sleep_s, next_log = 0.002, start + 10.0
        while (backlog := self._backlog()) > limit:
            now = time.monotonic()
            if timeout_s is not None and now - start >= timeout_s:
                raise QueueFull(
                    f"experience stream {self.stream!r} backlog is {backlog} (bound "
                    f"queue.max_backlog={self.max_backlog}) after waiting {timeout_s:.1f} s for "
                    f"room for {n}: is the learner consuming? Check it runs, or raise "
                    "queue.max_backlog"
                )
            if now >= next_log:
                log.warning("put waiting %.0f s: backlog %d over bound %d (is the learner running?)",
                            now - start, backlog, self.max_backlog)
                next_log = now + 60.0
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, 0.1)
        self._backlog_seen = backlog

    def put(self, groups: Sequence[Group], timeout_s: float | None = None,
            prompt_position: int | None = None) -> None:
        """Append the groups, one entry each, put_chunk entries at a time: each chunk is one
        script (its XADDs and the `produced` count, at most once however often the client
        retries it), which also measures the backlog for the next chunk.
        A chunk waits (up to timeout_s, None: forever; then QueueFull) while the backlog leaves
        no room for it; a chunk larger than max_backlog waits for an empty backlog. The check
        precedes the append, so concurrent producers may overshoot by one chunk each.
        `prompt_position`: this producer's prompt-stream position once these groups are in,
        recorded in the same transaction as the last chunk (see prompt_positions)."""
        start = time.monotonic()
        chunks = list(_chunks(groups, self.put_chunk)) or [[]]
        for i, chunk in enumerate(chunks):
            payloads = [encode(g) for g in chunk]
            if chunk and self._backlog_seen > max(self.max_backlog - len(chunk), 0):
                self._wait_for_room(len(chunk), timeout_s, start)
            position = prompt_position if prompt_position is not None and i == len(chunks) - 1 else ""
            self._backlog_seen = self._put_chunk(payloads, position)

    def _put_chunk(self, payloads: Sequence[bytes], position: int | str, seq: int | None = None) -> int:
        """Append one chunk at most once (redis_scripts.PUT), numbered `seq` (default: this
        producer's next); returns the backlog after it."""
        if seq is None:
            if self._put_seq is None:  # a restarted producer goes on from its predecessor's
                self._put_seq = int(self._r.hget(self.put_seq_key, self.consumer) or -1)
            self._put_seq = seq = self._put_seq + 1
        keys = [self.stream, self.counters_key, self.positions_key, self.put_seq_key, self.marker_key]
        return self._put_script(keys=keys, args=[self.consumer, seq, self.group, position, FIELD, PRODUCER,
                                                 MARK, *payloads])

    def prompt_positions(self) -> dict[str, int]:
        """Producer name -> how many prompts it had taken when its last put went in. A producer
        that restarts (a replaced generator, a resumed job) continues its prompt stream there:
        the prompts of every group in the stream are behind that point."""
        return {k.decode(): int(v) for k, v in self._r.hgetall(self.positions_key).items()}

    def restore_prompt_positions(self, positions: dict[str, int]) -> None:
        """Record positions (from a checkpoint) for the producers the stream knows nothing of:
        a stream that went on after the checkpoint keeps its own, newer ones."""
        pipe = self._r.pipeline(transaction=True)
        for name, position in positions.items():
            pipe.hsetnx(self.positions_key, name, position)
        pipe.execute()

    # -- consumer side ---------------------------------------------------------------------

    def _reclaim(self, count: int) -> list[tuple[bytes, dict]]:
        """Entries idle > claim_idle_ms in other consumers' hands, now this consumer's; those
        delivered more than max_deliveries times go to S:dead instead.

        Our own held entries that idled that long (a learner keeps some in its replay) are
        claimed by ids only, which resets their idle time without counting a delivery; the rest
        are then claimed with their data, which counts one, so the count a restarted consumer
        sees is the number of real deliveries."""
        cursor, ids, *_ = self._autoclaim_script(keys=[self.stream], args=[
            self.group, self.consumer, self.claim_idle_ms, self._claim_cursor, count])
        self._claim_cursor = cursor
        return self._claim([i for i in ids if i.decode() not in self._held])

    def _recover_own(self, count: int) -> list[tuple[bytes, dict]]:
        """Entries pending under this consumer's name that this object never received: a
        previous incarnation of the consumer (a restarted learner) held them when it died.
        They are ours, so take them at once rather than after claim_idle_ms. Called until it
        has paged past the last of them (they are the oldest of our pending entries, so they
        come first; those taken stay pending while held, so each call starts after the last)."""
        pending = self._r.xpending_range(self.stream, self.group, min=self._recover_after, max="+",
                                         count=count, consumername=self.consumer)
        if pending:
            self._recover_after = "(" + pending[-1]["message_id"].decode()  # exclusive: Redis >= 6.2
        self._recovering = bool(pending)
        return self._claim([p["message_id"] for p in pending if p["message_id"].decode() not in self._held])

    def _claim(self, ids: list[bytes]) -> list[tuple[bytes, dict]]:
        """Claim `ids` with their fields (one more delivery each); those delivered more than
        max_deliveries times go to S:dead instead."""
        if not ids:
            return []
        pipe = self._r.pipeline(transaction=False)
        pipe.xclaim(self.stream, self.group, self.consumer, 0, ids)
        for entry_id in ids:
            pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        claimed, *pending = pipe.execute()
        deliveries = {p[0]["message_id"]: p[0]["times_delivered"] for p in pending if p}
        keep, poison = [], []
        for entry_id, fields in claimed:
            if fields is None:  # deleted while pending (Redis 6.2 reports it as nil)
                continue
            n = deliveries.get(entry_id, 0)
            if n <= self.max_deliveries:
                keep.append((entry_id, fields))
            else:
                why = (f"delivered {n} times (queue.max_deliveries={self.max_deliveries}) and never "
                       "acked: its consumers died or stalled on it each time")
                poison.append((entry_id.decode(), TrajectoryError("max_deliveries", why), fields.get(FIELD, b"")))
        if poison:
            self._dead_letter(poison, {i.decode() for i, f in claimed if f is not None and self._foreign(f)})
        if keep:
            self._r.hincrby(self.counters_key, "reclaimed", len(keep))
            log.info("reclaimed %d entries left by dead or stalled consumers", len(keep))
        return keep

    def get(self, count: int, block_ms: int = 1000) -> list[Received]:
        """Up to `count` entries (groups): those idle > claim_idle_ms in another consumer's hands if
        any, else new ones, waiting up to block_ms (<= 0: not at all) for some to arrive.
        Malformed entries are dead-lettered instead of returned."""
        if count <= 0:
            raise ValueError(f"count must be > 0, got {count}")
        entries = (self._recovering and self._recover_own(count)) or self._reclaim(count)
        if not entries:
            reply = self._r.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count,
                block=block_ms if block_ms > 0 else None,
            )
            if isinstance(reply, dict):  # RESP3 client: {stream: [entries]}
                reply = [[k, v[0]] for k, v in reply.items()]
            entries = reply[0][1] if reply else []
            if n_foreign := sum(self._foreign(f) for _, f in entries):  # first delivery: count once
                self._r.hincrby(self.counters_key, "foreign", n_foreign)
        why = ("written by another client: the entry lacks this stream's marker (only our put writes "
               f"it, from {self.marker_key}), whatever its other fields")
        foreign = {i.decode(): f.get(FIELD, b"") for i, f in entries if self._foreign(f)}
        ours = [(i, f.get(FIELD, b"")) for i, f in entries if i.decode() not in foreign]
        out, bad = [], [(i, TrajectoryError("foreign", why), data) for i, data in foreign.items()]
        for (raw_id, data), group in zip(ours, decode_batch([data for _, data in ours])):
            if type(group) is Group:
                out.append(Received(raw_id.decode(), group))
            else:
                bad.append((raw_id.decode(), group, data))
        self._held.update([r.entry_id for r in out])
        if bad:
            order = {i.decode(): n for n, (i, _) in enumerate(entries)}
            self._dead_letter(sorted(bad, key=lambda b: order[b[0]]), set(foreign))
        return out

    def _foreign(self, fields: dict) -> bool:
        return fields.get(MARK) != self._marker

    def duplicates(self, received: Sequence[Received]) -> list[str]:
        """The entry ids, of `received`, whose group id an earlier entry of the stream carried
        (of the newest GROUP_IDS_KEPT ids): copies, to be acked unused. The first entry with an
        id keeps it, delivered again or not, whichever consumer asks and however often."""
        copies: list[str] = []
        for chunk in _chunks(received, _SCRIPT_CHUNK):
            args = [GROUP_IDS_KEPT, *(x for r in chunk for x in (r.entry_id, r.group.group_id))]
            copies += [i.decode() for i in self._copies_script(
                keys=[self.group_ids_key, self.group_order_key], args=args)]
        return copies

    def reject(self, rejected: Sequence[tuple[Received, TrajectoryError]]) -> None:
        """Move received entries that cannot be trained on to S:dead, re-encoded, with their
        reason, counted `dead_lettered` (only those this consumer still owns)."""
        if rejected:
            self._dead_letter([(r.entry_id, err, encode(r.group)) for r, err in rejected])
            self._held.difference_update(r.entry_id for r, _ in rejected)

    def _dead_letter(self, bad: list[tuple[str, TrajectoryError, bytes]], foreign: Set[str] = frozenset()) -> None:
        """Entries of `foreign` (another client's) are counted dead_lettered_foreign: they were
        never `produced` and never held a slot of the staleness gate (not_trained)."""
        args: list = [self.group, self.consumer, self.dead_letter_maxlen]
        for entry_id, err, data in bad:
            log.warning("dead-lettering entry %s: %s", entry_id, err)
            counter = "dead_lettered_foreign" if entry_id in foreign else "dead_lettered"
            args += [entry_id, err.reason, err.detail, data, counter]
        self._dead_script(keys=[self.stream, self.dead_stream, self.counters_key], args=args)

    def _owned_args(self, ids: Sequence[str]) -> list:
        """min id, max id, XPENDING limit: the OWNED check's arguments for a chunk of ids."""
        keys = sorted(tuple(map(int, i.split("-"))) for i in ids)
        limit = len(ids) + len(self._held) + 16  # our pending entries in that range, at most
        return ["%d-%d" % keys[0], "%d-%d" % keys[-1], limit]

    def ack(self, entry_ids: Sequence[str], reason: str = "trained") -> None:
        """Acknowledge entries this consumer still owns and count them under `reason`; ids it
        no longer owns (reclaimed by another consumer) are counted as `ack_lost`, not acked."""
        lost: list[bytes] = []
        for chunk in _chunks(list(entry_ids), _SCRIPT_CHUNK):
            args = [self.group, self.consumer, reason, *self._owned_args(chunk), *chunk]
            lost += self._ack_script(keys=[self.stream, self.counters_key, self.held_key], args=args)
        self._held.difference_update(entry_ids)
        if lost:
            log.warning("%d acks (%s) for entries now owned by another consumer: not counted",
                        len(lost), reason)

    def renew(self, entry_ids: Iterable[str] | None = None) -> list[str]:
        """Of `entry_ids` (default: all held), those this consumer still owns, with their idle
        time reset so that no one reclaims them for another claim_idle_ms."""
        ids = list(self._held if entry_ids is None else entry_ids)
        owned: list[str] = []
        for chunk in _chunks(ids, _SCRIPT_CHUNK):
            args = [self.group, self.consumer, "", *self._owned_args(chunk), *chunk]
            owned += [i.decode() for i in self._renew_script(keys=[self.stream], args=args)]
        self._held.difference_update(set(ids) - set(owned))
        return owned

    def hold(self, entry_ids: Sequence[str], version: int) -> list[str]:
        """The learner at `version` holds `entry_ids` (trained, no checkpoint has their update
        yet) until it acks them: of them, those this consumer still owns, with their idle time
        reset as `renew` does (held across steps, they are never reclaimed, nor counted as
        delivered again), recorded in S:held, and `version` as the learner's, all in one step.
        Call it at each step with all the ids held."""
        owned: list[str] = []
        for chunk in _chunks(list(entry_ids), _SCRIPT_CHUNK) if entry_ids else [[]]:
            args = [self.group, self.consumer, version, *(self._owned_args(chunk) if chunk else []), *chunk]
            owned += [i.decode() for i in self._hold_script(keys=[self.stream, self.held_key, self.version_key],
                                                               args=args)]
        return owned

    def learner_restarted(self, version: int) -> None:
        """A learner (re)started from a checkpoint at `version`: it holds nothing yet, and what
        its predecessor held is queued again, to be trained again (its pending entries)."""
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self.held_key)
        pipe.set(self.version_key, version)
        pipe.execute()

    def dead_letter(self, reason: str, detail: str, payload: bytes = b"") -> None:
        """Record something that never entered the stream and will never be trained on (e.g. a
        group one of whose rewards failed) in S:dead, with an empty original_id. Counted once as
        `set_aside` and `set_aside:<reason>`, not `dead_lettered`: it was never `produced`, and
        produced = trained + dropped_* + dead_lettered + backlog + pending must keep holding."""
        pipe = self._r.pipeline(transaction=True)
        pipe.xadd(self.dead_stream, {"id": "", "reason": reason, "detail": detail,
                                     "consumer": self.consumer, "raw": payload},
                  maxlen=self.dead_letter_maxlen, approximate=True)
        pipe.hincrby(self.counters_key, "set_aside", 1)
        pipe.hincrby(self.counters_key, f"set_aside:{reason}", 1)
        pipe.execute()
        log.warning("dead letter from %s: %s: %s", self.consumer, reason, detail)

    def count_dropped(self, reason: str) -> None:
        """Count a group its producer dropped (generator.drop_uniform_groups) as dropped_<reason>:
        an event, like set_aside, outside produced = trained + dropped_* + ... (Accounting)."""
        self._r.hincrby(self.counters_key, f"dropped_{reason}", 1)

    # -- inspection --------------------------------------------------------------------------

    def stats(self) -> QueueStats:
        pipe = self._r.pipeline(transaction=True)  # one consistent snapshot
        pipe.xlen(self.stream)
        pipe.xpending(self.stream, self.group)
        pipe.xlen(self.dead_stream)
        pipe.hgetall(self.counters_key)
        pipe.scard(self.held_key)
        pipe.get(self.version_key)
        length, pending, dead, counters, held, version = pipe.execute()
        return QueueStats(
            backlog=length - pending["pending"],
            pending=pending["pending"],
            dead_letters=dead,
            counters={k.decode(): int(v) for k, v in counters.items()},
            held=held,
            learner_version=int(version or 0),
        )

    def accounting(self, stats: QueueStats | None = None) -> Accounting:
        """Where every entry (group) went, from the shared counters (see Accounting); `stats`:
        ones just read, else they are read now."""
        stats = self.stats() if stats is None else stats
        return Accounting.from_counters(stats.counters, stats.backlog + stats.pending - stats.held,
                                        self._foreign_backlog(), awaiting_checkpoint=stats.held)

    def _foreign_backlog(self) -> int:
        """Entries without the stream's marker that no consumer has read yet."""
        last = next(g["last-delivered-id"].decode() for g in self._r.xinfo_groups(self.stream)
                    if g["name"] == self.group.encode())
        return sum(map(self._foreign, (f for _, f in self._r.xrange(self.stream, min=f"({last}", max="+"))))

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The most recent `count` dead letters, oldest first."""
        reply = self._r.xrevrange(self.dead_stream, count=count)
        return [
            DeadLetter(
                dead_id=dead_id.decode(), original_id=f[b"id"].decode(),
                reason=f[b"reason"].decode(), detail=f[b"detail"].decode(errors="replace"),
                consumer=f[b"consumer"].decode(), raw=f[b"raw"],
            )
            for dead_id, f in reversed(reply)
        ]

    def close(self) -> None:
        self._r.close()
