"""RedisExperienceQueue against a real redis-server: delivery, reclaim after a consumer is
SIGKILLed, exactly-once acknowledgement, backpressure, dead letters, durability."""

import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from async_rlhf.config import QueueConfig
from async_rlhf.messages import not_trained
from async_rlhf.types import TrajectoryError
from buffer.codec import decode, encode
from buffer import redis_stream
from buffer.redis_server import EmbeddedRedis
from buffer.redis_stream import FIELD, MARK, QueueFull, RedisExperienceQueue
from helpers import ReplyLosingProxy, make_group, reencoded

REPO = Path(__file__).resolve().parents[1]


def ids_of(got) -> list[str]:
    """The group ids of received entries, in order."""
    return [r.group.group_id for r in got]


def stream_ids(client, stream) -> list[str]:
    return [entry_id.decode() for entry_id, _ in client.xrange(stream)]


@pytest.fixture
def make_queue(redis_client, stream_name):
    def make(consumer="learner-0", **kwargs):
        return RedisExperienceQueue(redis_client, consumer, stream=stream_name, **kwargs)

    return make


def test_round_trip_every_field_and_counters(make_queue):
    queue = make_queue()
    sent = [make_group(i, size=1 + i % 3) for i in range(6)]
    queue.put(sent)
    assert queue.stats().backlog == 6
    got = queue.get(10, block_ms=0)
    assert len(got) == 6
    for group, received in zip(sent, got):
        assert received.group.size == group.size
        for original, t in zip(group.members, received.group.members):
            for name in ("prompt_ids", "response_ids", "behavior_logprobs"):
                assert np.array_equal(getattr(t, name), getattr(original, name))
                assert getattr(t, name).dtype == getattr(original, name).dtype
            for name in ("reward", "reward_parts", "policy_version", "generator_id", "group_id",
                         "finished", "generated_at", "generation_s", "schema_version"):
                assert getattr(t, name) == getattr(original, name), name
    stats = queue.stats()
    assert (stats.backlog, stats.pending) == (0, 6)
    queue.ack([r.entry_id for r in got[:4]], "trained")
    queue.ack([r.entry_id for r in got[4:]], "dropped_stale")
    stats = queue.stats()
    assert (stats.backlog, stats.pending, stats.dead_letters) == (0, 0, 0)
    assert stats.counters == {"produced": 6, "trained": 4, "dropped_stale": 2}


def test_one_entry_per_group_whatever_the_chunk_and_fates_act_on_whole_groups(
    redis_client, make_queue, stream_name
):
    """put chunks count entries, so a group is never split; counters count groups; a reject
    sets the whole group aside, with all its members' bytes."""
    queue = make_queue(put_chunk=3)
    queue.put([make_group(i, size=4) for i in range(7)])
    entries = redis_client.xrange(stream_name)
    assert [decode(f[FIELD]).size for _, f in entries] == [4] * 7
    got = queue.get(10, block_ms=0)
    assert ids_of(got) == [f"group-{i}" for i in range(7)]
    queue.reject([(got[2], TrajectoryError("token_id", "token id 300 outside [0, 256)"))])
    queue.ack([r.entry_id for r in got if r is not got[2]])
    [dead] = queue.dead_letters()
    assert dead.reason == "token_id" and dead.original_id == got[2].entry_id
    assert decode(dead.raw).size == 4 and decode(dead.raw).group_id == "group-2"
    assert queue.stats().counters == {"produced": 7, "trained": 6, "dead_lettered": 1}


def test_prompt_positions_go_in_with_the_groups_and_a_checkpoint_fills_only_gaps(make_queue):
    gen0, gen1 = make_queue("gen-0", put_chunk=2), make_queue("gen-1")
    assert gen0.prompt_positions() == {}
    gen0.put([make_group(i) for i in range(5)], prompt_position=5)  # three chunks
    gen1.put([], prompt_position=3)  # every group of the batch set aside: still taken
    gen0.put([make_group(5)])  # no position given: the recorded one stays
    assert gen0.prompt_positions() == {"gen-0": 5, "gen-1": 3}
    gen0.restore_prompt_positions({"gen-0": 2, "gen-2": 7})  # from an older checkpoint
    assert gen1.prompt_positions() == {"gen-0": 5, "gen-1": 3, "gen-2": 7}
    assert gen0.stats().counters == {"produced": 6}


def test_entries_written_by_a_foreign_client_are_counted_and_accounted(make_queue, redis_client,
                                                                       stream_name):
    """Another client's entries, whatever fields they carry, are foreign: told by the stream's
    marker, which only our put writes. They are dead-lettered as foreign, never trained, free
    no gate slot, and the balance holds with lost = 0. (Before the marker, an entry with our
    producer field b"p" counted as ours: lost went negative by one per such entry.)"""
    queue = make_queue()
    queue.put([make_group(0), make_group(1)])
    good = encode(make_group(7))
    foreign = [
        {b"x": b"1"},  # none of our fields
        {FIELD: b"not msgpack"},
        {FIELD: b"garbage", b"p": b"gen-0", MARK: b"a guess"},  # garbage under all our field names
        {FIELD: reencoded(make_group(5), schema_version=99), b"p": b"gen-0"},  # another schema
        {FIELD: good[: len(good) // 2], b"p": b"gen-0"},  # truncated msgpack
        {FIELD: good, b"p": b"gen-0"},  # a valid group, by another client: not trained either
    ]
    for fields in foreign:
        redis_client.xadd(stream_name, fields)
    assert queue.accounting().foreign == 6  # undelivered yet
    got = queue.get(10, block_ms=0)
    assert [r.group.group_id for r in got] == ["group-0", "group-1"]
    assert queue.get(10, block_ms=0) == []  # the foreign ones are dead-lettered on delivery
    queue.ack([r.entry_id for r in got])
    summary = queue.accounting()
    assert summary.counters["foreign"] == 6 and summary.foreign == 6
    assert (summary.produced, summary.trained, summary.dead_lettered) == (2, 2, 6)
    assert summary.lost == 0 and summary.left_in_queue == 0
    assert {d.reason for d in queue.dead_letters()} == {"foreign"}
    # they never held gate slots: nothing of ours went untrained, so no slot is given back
    assert summary.counters["dead_lettered_foreign"] == 6 and not_trained(summary.counters) == 0


def test_held_entries_stay_pending_unreclaimed_until_acked(make_queue, redis_client, stream_name):
    """What the learner trained waits, pending and held, for the checkpoint that holds it: no
    other consumer reclaims it (its idle time is reset at each hold), no delivery is counted for
    holding it (max_deliveries), and the books name it awaiting_checkpoint until its ack."""
    learner = make_queue(claim_idle_ms=600)
    learner.put([make_group(g) for g in range(3)])
    got = learner.get(3, block_ms=0)
    ids = [r.entry_id for r in got]
    for version in (1, 2, 3):  # three steps, each longer than claim_idle_ms
        assert learner.hold(ids[:2], version) == ids[:2]
        time.sleep(0.35)
    other = make_queue("learner-1", claim_idle_ms=600)
    assert ids_of(other.get(3, block_ms=0)) == ["group-2"]  # the one not held is reclaimed
    stats = learner.stats()
    assert (stats.held, stats.learner_version, stats.pending) == (2, 3, 3)
    assert all(p["times_delivered"] == 1
               for p in redis_client.xpending_range(stream_name, "learners", "-", "+", 10)
               if p["message_id"].decode() in ids[:2])
    acc = learner.accounting()
    assert (acc.awaiting_checkpoint, acc.left_in_queue, acc.lost) == (2, 1, 0)
    learner.ack(ids[:2])  # the checkpoint is complete: trained for good
    stats = learner.stats()
    assert (stats.held, stats.counters["trained"]) == (0, 2)
    learner.hold(ids[:2], 4)  # after their ack there is nothing to hold
    learner.learner_restarted(1)
    assert (learner.stats().held, learner.stats().learner_version) == (0, 1)


def test_a_put_whose_reply_is_lost_is_retried_without_a_duplicate(redis_server, stream_name):
    """Through a TCP proxy that drops the connection after the server has run a put and before
    its reply arrives (every second call: so every put after the first loses its reply once, and
    its retry goes through): the client's retry (queue clients retry for about a
    minute) appends nothing twice, and a restarted producer of that name numbers on from there."""
    proxy = ReplyLosingProxy(redis_server.url, every=2)
    cfg = QueueConfig(stream=stream_name)
    queue = RedisExperienceQueue.from_config(cfg, proxy.url, consumer="gen-0")
    for g in range(6):
        queue.put([make_group(2 * g), make_group(2 * g + 1)], prompt_position=2 * g + 2)
    assert len(stream_ids(queue._r, stream_name)) == 12 and queue.stats().counters["produced"] == 12
    restarted = RedisExperienceQueue.from_config(cfg, proxy.url, consumer="gen-0")
    restarted.put([make_group(12)], prompt_position=13)
    assert len(stream_ids(queue._r, stream_name)) == 13 and restarted.prompt_positions() == {"gen-0": 13}
    assert proxy.lost >= 6  # of 7 puts
    queue.close()
    restarted.close()
    proxy.close()


def test_a_restarted_consumer_takes_back_what_its_predecessor_held_at_once(make_queue):
    producer = make_queue("gen-0")
    producer.put([make_group(i) for i in range(5)])
    dead = make_queue("learner-0", claim_idle_ms=60_000)
    assert len(dead.get(3, block_ms=0)) == 3  # then it dies without acking
    other = make_queue("learner-1", claim_idle_ms=60_000)
    restarted = make_queue("learner-0", claim_idle_ms=60_000)
    # one at a time, the earlier ones still held (a learner acks at its next checkpoint)
    assert [r.group.group_id for r in restarted.get(1, block_ms=0)] == ["group-0"]
    assert [r.group.group_id for r in restarted.get(1, block_ms=0)] == ["group-1"]
    assert [r.group.group_id for r in restarted.get(10, block_ms=0)] == ["group-2"]
    assert [r.group.group_id for r in restarted.get(10, block_ms=0)] == ["group-3", "group-4"]
    assert other.get(10, block_ms=0) == []  # nothing idle long enough for anyone else
    assert restarted.stats().counters["reclaimed"] == 3


def test_copies_of_a_group_id_are_found_but_not_redeliveries(make_queue, monkeypatch):
    """The first entry with a group id keeps it: its copies are found, whichever consumer
    asks, while that entry delivered again (to a restarted consumer) is no copy of itself.
    Only the newest GROUP_IDS_KEPT ids are remembered."""
    make_queue("generator-0").put([make_group(0), make_group(0), make_group(1), make_group(0)])
    first = make_queue("learner-0")
    got = first.get(2)
    assert first.duplicates(got) == [got[1].entry_id]
    again = make_queue("learner-0")  # a restart: takes back what its predecessor held
    back = again.get(2)
    assert [r.entry_id for r in back] == [r.entry_id for r in got]
    assert again.duplicates(back) == [got[1].entry_id]
    rest = again.get(2)
    assert again.duplicates(rest) == [rest[1].entry_id]  # group 1 is new, group 0 no longer
    monkeypatch.setattr(redis_stream, "GROUP_IDS_KEPT", 1)
    make_queue("generator-0").put([make_group(2), make_group(0)])
    assert again.duplicates(again.get(1)) == []  # group 2, new: the only id remembered now
    assert again.duplicates(again.get(1)) == []  # so group 0 is forgotten
    assert again._r.hlen(again.group_ids_key) == again._r.llen(again.group_order_key) == 1


def test_from_config_and_empty_get(redis_server, stream_name):
    cfg = QueueConfig(stream=stream_name, max_backlog=10, claim_idle_ms=100)
    queue = RedisExperienceQueue.from_config(cfg, redis_server.url, "learner-0")
    assert queue.get(10, block_ms=0) == []
    assert queue.max_backlog == 10 and queue.stats().counters == {}
    queue.close()


def test_get_blocks_until_an_entry_arrives(make_queue):
    queue, producer = make_queue(), make_queue("generator-0")
    timer = threading.Timer(0.2, producer.put, args=([make_group(1)],))
    timer.start()
    got = queue.get(5, block_ms=20_000)
    timer.join()
    assert ids_of(got) == ["group-1"]


CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import redis
from buffer.redis_stream import RedisExperienceQueue
url, stream = sys.argv[2], sys.argv[3]
queue = RedisExperienceQueue(redis.Redis.from_url(url), "doomed", stream=stream)
got = queue.get(8, block_ms=5000)
queue.ack([r.entry_id for r in got[:3]])  # trained 3, then dies holding 5
print(json.dumps([r.entry_id for r in got]), flush=True)
sys.stdin.read()  # wait to be killed
"""


def test_sigkilled_consumer_entries_are_reclaimed_none_lost_none_twice(
    redis_server, redis_client, make_queue, stream_name
):
    make_queue("generator-0").put([make_group(i) for i in range(20)])
    all_ids = stream_ids(redis_client, stream_name)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(REPO), redis_server.url, stream_name],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        held = json.loads(child.stdout.readline())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert len(held) == 8
    trained = held[:3]
    survivor = make_queue("survivor", claim_idle_ms=50)
    deadline = time.monotonic() + 30
    while len(trained) < 20 and time.monotonic() < deadline:
        got = survivor.get(6, block_ms=100)
        survivor.ack([r.entry_id for r in got])
        trained += [r.entry_id for r in got]
    assert sorted(trained) == sorted(all_ids)  # none lost, none trained twice
    stats = survivor.stats()
    assert (stats.backlog, stats.pending) == (0, 0)
    assert stats.counters == {"produced": 20, "trained": 20, "reclaimed": 5}


def test_stalled_consumer_cannot_ack_what_was_reclaimed(make_queue):
    make_queue("generator-0").put([make_group(i) for i in range(4)])
    slow = make_queue("slow", claim_idle_ms=1)
    fast = make_queue("fast", claim_idle_ms=1)
    mine = [r.entry_id for r in slow.get(4, block_ms=0)]
    time.sleep(0.05)  # idle > claim_idle_ms: the slow consumer looks dead
    stolen = [r.entry_id for r in fast.get(4, block_ms=0)]
    assert sorted(stolen) == sorted(mine)
    assert slow.renew(mine) == []  # a learner checks this before its optimizer step
    slow.ack(mine)  # too late: not acked, not counted as trained
    assert fast.stats().pending == 4
    fast.ack(stolen)
    stats = fast.stats()
    assert stats.pending == 0
    assert stats.counters == {"produced": 4, "reclaimed": 4, "ack_lost": 4, "trained": 4}


def test_an_entry_never_acked_is_dead_lettered_after_max_deliveries(make_queue):
    """A poison entry (its consumers keep dying on it) stops going round: after max_deliveries
    deliveries the next reclaim moves it to the dead-letter stream with its bytes."""
    poison, good = make_group(1), make_group(2)
    make_queue("generator-0").put([poison])
    consumers = [make_queue(f"learner-{i}", claim_idle_ms=1, max_deliveries=2) for i in range(3)]
    assert len(consumers[0].get(5, block_ms=0)) == 1  # delivery 1: learner-0 dies on it
    time.sleep(0.05)
    assert len(consumers[1].get(5, block_ms=0)) == 1  # delivery 2 (reclaimed): learner-1 dies too
    make_queue("generator-0").put([good])
    time.sleep(0.05)
    got = consumers[2].get(5, block_ms=0)  # delivery 3 > 2: set aside; new entries flow
    assert ids_of(got) == [good.group_id]
    [dead] = consumers[2].dead_letters()
    assert dead.reason == "max_deliveries" and "delivered 3 times" in dead.detail
    assert dead.raw == encode(poison)
    consumers[2].ack([r.entry_id for r in got])
    stats = consumers[2].stats()
    assert stats.pending == stats.backlog == 0
    assert stats.counters == {"produced": 2, "reclaimed": 1, "dead_lettered": 1, "trained": 1}


def test_own_idle_entries_do_not_count_as_deliveries(make_queue):
    """An entry a learner holds (in its replay) past claim_idle_ms is claimed back by its own
    get() again and again; none of that counts, so after a restart under the same name it is
    delivered once more, not taken for a poison entry."""
    make_queue("generator-0").put([make_group(1)])
    queue = make_queue("learner-0", claim_idle_ms=1, max_deliveries=2)
    [held] = queue.get(5, block_ms=0)
    for _ in range(4):
        time.sleep(0.01)
        assert queue.get(5, block_ms=0) == []
    restarted = make_queue("learner-0", claim_idle_ms=1, max_deliveries=2)  # after a crash
    time.sleep(0.01)
    [again] = restarted.get(5, block_ms=0)
    assert again.entry_id == held.entry_id and restarted.dead_letters() == []


def test_renew_keeps_entries_and_own_idle_entries_are_not_redelivered(make_queue):
    make_queue("generator-0").put([make_group(i) for i in range(3)])
    queue = make_queue(claim_idle_ms=1)
    first = [r.entry_id for r in queue.get(2, block_ms=0)]
    time.sleep(0.05)
    # Its own idle entries are reclaimed by itself, not handed out again; new ones are.
    second = [r.entry_id for r in queue.get(5, block_ms=0)]
    assert len(second) == 1 and second[0] not in first
    time.sleep(0.05)
    assert queue.get(5, block_ms=0) == []
    assert sorted(queue.renew()) == sorted(first + second)
    queue.ack(first + second)
    assert queue.stats().counters == {"produced": 3, "trained": 3}


def test_backpressure_blocks_then_resumes(make_queue):
    producer = make_queue("generator-0", max_backlog=4)
    consumer = make_queue()
    producer.put([make_group(i) for i in range(4)])
    started, done = threading.Event(), threading.Event()

    def produce():
        started.set()
        producer.put([make_group(9)])
        done.set()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    assert started.wait(10)
    assert not done.wait(0.3)  # backlog 4 of 4: the put waits
    assert producer.stats().backlog == 4
    consumer.get(2, block_ms=0)  # delivered (not yet acked) entries leave the backlog
    assert done.wait(30)
    thread.join(10)
    assert producer.stats().backlog == 3


def test_backpressure_timeout_names_bound_and_fix(make_queue):
    producer = make_queue("generator-0", max_backlog=2)
    producer.put([make_group(0), make_group(1)])
    with pytest.raises(QueueFull, match=r"max_backlog=2.*learner"):
        producer.put([make_group(2)], timeout_s=0.2)
    assert producer.stats().counters["produced"] == 2  # nothing appended, nothing trimmed


@pytest.mark.parametrize("count", [3, 100])  # 100: one batch, whose log-prob check fails
def test_malformed_entries_are_dead_lettered_while_good_ones_flow(
    redis_client, make_queue, stream_name, count
):
    bad = {
        "garbage": b"\xc1\x00not msgpack",
        "schema": reencoded(make_group(0), schema_version=99),
        "non_finite_reward": encode(make_group(0, reward=math.nan)),
        "non_finite_logprob": encode(
            make_group(0, behavior_logprobs=np.array([-1, math.nan, -1, -1], np.float32))
        ),
        "length_mismatch": encode(make_group(0, behavior_logprobs=np.array([-1.0], np.float32))),
        "missing_field": reencoded(make_group(0), member=1, reward=None),
    }
    producer = make_queue("generator-0")
    marker = redis_client.get(f"{stream_name}:marker")
    for i, payload in enumerate(bad.values()):
        producer.put([make_group(10 + i)])
        # a buggy producer of ours (it has the stream's marker), bypassing encode
        redis_client.xadd(stream_name, {FIELD: payload, MARK: marker})
    redis_client.xadd(stream_name, {b"other": b"x"})  # another client's: no marker, no payload
    consumer = make_queue()
    got = []
    while batch := consumer.get(count, block_ms=0):
        got += batch
    assert sorted(ids_of(got)) == sorted(f"group-{10 + i}" for i in range(6))
    stats = consumer.stats()
    assert (stats.backlog, stats.pending, stats.dead_letters) == (0, 6, 7)
    assert (stats.counters["dead_lettered"], stats.counters["dead_lettered_foreign"]) == (6, 1)
    letters = consumer.dead_letters()
    assert [d.reason for d in letters] == [*bad, "foreign"]
    assert [d.raw for d in letters] == [*bad.values(), b""]
    assert all(d.original_id and d.consumer == "learner-0" and d.detail for d in letters)
    consumer.ack([r.entry_id for r in got])
    assert consumer.stats().pending == 0


def test_producer_side_dead_letter(make_queue):
    queue = make_queue("generator-0")
    queue.dead_letter("reward_failed", "reward model timed out after 3 tries", b'{"prompt": 1}')
    (letter,) = queue.dead_letters()
    assert (letter.reason, letter.original_id, letter.raw) == ("reward_failed", "", b'{"prompt": 1}')
    assert queue.stats().counters == {"set_aside": 1, "set_aside:reward_failed": 1}


def test_durable_redis_sigkilled_and_restarted_keeps_stream_and_pending(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", durable=True).start()
    try:
        client = redis.Redis.from_url(server.url)
        queue = RedisExperienceQueue(client, "learner-0", stream="durable")
        queue.put([make_group(i) for i in range(10)])
        got = queue.get(4, block_ms=0)
        queue.ack([got[0].entry_id])
        pending = sorted(r.entry_id for r in got[1:])
        client.close()
        server.kill()  # SIGKILL: no shutdown, no final fsync
        server.start()  # same port, password and directory: Redis replays its AOF
        client = redis.Redis.from_url(server.url)
        other = RedisExperienceQueue(client, "learner-1", stream="durable", claim_idle_ms=1)
        stats = other.stats()
        assert (stats.backlog, stats.pending) == (6, 3)
        assert stats.counters == {"produced": 10, "trained": 1}
        time.sleep(0.01)
        reclaimed = other.get(10, block_ms=0)
        assert sorted(r.entry_id for r in reclaimed) == pending
        rest = other.get(10, block_ms=0)
        assert len(rest) == 6
        other.ack([r.entry_id for r in reclaimed + rest])
        assert other.stats().counters == {"produced": 10, "trained": 10, "reclaimed": 3}
        client.close()
    finally:
        server.close()


def test_renew_resets_idle_time_so_nobody_reclaims(redis_client, make_queue, stream_name):
    make_queue("generator-0").put([make_group(0)])
    queue = make_queue()
    (entry,) = queue.get(1, block_ms=0)

    def idle_ms() -> int:
        (pending,) = redis_client.xpending_range(stream_name, "learners", "-", "+", 1)
        return pending["time_since_delivered"]

    time.sleep(0.3)
    before = idle_ms()
    assert queue.renew([entry.entry_id]) == [entry.entry_id]
    assert idle_ms() < before


@pytest.mark.parametrize("protocol", [2, 3])
def test_resp2_and_resp3_clients(redis_server, stream_name, protocol):
    client = redis.Redis.from_url(redis_server.url, protocol=protocol)
    queue = RedisExperienceQueue(client, "learner-0", stream=stream_name)
    queue.put([make_group(1), make_group(2)])
    client.xadd(stream_name, {FIELD: b"junk"})
    got = queue.get(10, block_ms=1000)
    assert ids_of(got) == ["group-1", "group-2"]
    queue.ack([r.entry_id for r in got])
    stats = queue.stats()
    assert (stats.backlog, stats.pending, stats.dead_letters) == (0, 0, 1)
    assert queue.dead_letters()[0].reason == "foreign"  # no marker: another client's
    client.close()
