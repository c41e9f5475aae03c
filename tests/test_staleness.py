"""The staleness gate, checked by simulating generators and a learner that trains in order."""

import random

import pytest

from async_rlhf.staleness import StalenessGate
from buffer.codec import encode
from helpers import make_group


def test_capacity_by_hand():
    gate = StalenessGate(max_staleness=2, batch_size=4)
    assert gate.capacity(version=0) == 12  # (2 + 0 + 1) * 4
    assert gate.try_admit(8, version=0)
    assert gate.capacity(version=0) == 4
    assert gate.try_admit(8, version=0)  # a slot is free: the whole batch goes
    assert gate.capacity(version=0) == 0
    assert not gate.try_admit(1, version=0)
    gate.finish(8, 8)
    gate.finish(8, 6)  # two samples set aside
    assert (gate.accepted, gate.running) == (14, 0)
    assert gate.capacity(version=1) == 2
    gate.forget(8)
    assert gate.capacity(version=0) == 6
    assert gate.capacity(version=1) == 10


def test_k0_is_synchronous():
    gate = StalenessGate(max_staleness=0, batch_size=8)
    assert gate.try_admit(8, version=0)
    assert not gate.try_admit(8, version=0)  # must wait for the learner's version 1
    gate.finish(8, 8)
    assert not gate.try_admit(8, version=0)
    assert gate.try_admit(8, version=1)


def test_a_step_that_reuses_samples_moves_the_rest_back():
    gate = StalenessGate(max_staleness=1, batch_size=8)
    gate.try_admit(16, version=0)
    gate.finish(16, 16)
    assert gate.capacity(version=1) == 8  # (1 + 1 + 1) * 8 - 16
    gate.step_trained(fresh=5)  # 3 of the 8 re-used: 3 of the 16 now train a step later
    assert gate.capacity(version=1) == 5
    gate.step_trained(fresh=8)
    assert gate.capacity(version=1) == 5
    with pytest.raises(ValueError, match=r"step_trained\(9\)"):
        gate.step_trained(9)


# ---- the job's gate (launch/roles.Coordinator): its books are read from a real stream
@pytest.fixture
def job_gate(redis_server, stream_name):
    """(coordinator with k=1, batch 8, groups of 4; a producer's queue; the learner's queue)."""
    from async_rlhf.config import QueueConfig
    from async_rlhf.launch.roles import Coordinator
    from async_rlhf.launch.stream import StreamBooks
    from buffer.redis_stream import RedisExperienceQueue

    cfg = QueueConfig(stream=stream_name)
    coordinator = Coordinator(max_staleness=1, batch_size=8,
                              books=StreamBooks(cfg, redis_server.url, batch_size=8, group_size=4))
    queues = [RedisExperienceQueue.from_config(cfg, redis_server.url, consumer=c) for c in ("gen-0", "learner-0")]
    yield coordinator, *queues
    for q in queues:
        q.close()


def test_a_resumed_gate_holds_the_slots_of_groups_in_the_stream(job_gate):
    # 32 groups (128 samples, more than the gate's 16 slots at version 0) in the stream: nothing
    # new is admitted while they come first, and dropping them all gives every slot back
    coordinator, producer, learner = job_gate
    producer.put([make_group(g) for g in range(32)])
    assert not coordinator.try_admit("gen-0", 0, 4, version=0)
    learner.ack([r.entry_id for r in learner.get(32, block_ms=0)], reason="dropped_stale")
    assert coordinator.try_admit("gen-0", 0, 4, version=0) and coordinator.gate.capacity(0) == 12


def test_a_put_during_a_learner_restart_is_counted(job_gate):
    """The learner trains step 1 (2 groups, held for a checkpoint) and dies; a generator's put
    and finish land while it restarts from v0. The gate counts the put, and the two groups to
    train again, with no rebase to race with. (The launcher used to read the stream, then set
    accepted from it after the learner was back: a put between the two was lost.)"""
    coordinator, producer, learner = job_gate
    producer.put([make_group(0), make_group(1)])
    assert coordinator.try_admit("gen-0", 0, 4, version=0)
    got = learner.get(2, block_ms=0)
    learner.hold([r.entry_id for r in got], version=1)  # trained at step 1, no checkpoint yet
    # the learner dies; meanwhile gen-0 puts and finishes the group it was admitted for
    producer.put([make_group(2)])
    coordinator.finish("gen-0", 0, 4)
    learner.learner_restarted(0)  # back from the checkpoint at v0: its 2 groups are to train again
    assert coordinator.try_admit("gen-0", 0, 4, version=1)
    assert coordinator.gate.accepted == 3 * 4 and coordinator.gate.running == 4
    # gen-0's weights (v1) are ahead of the learner (v0): it is admitted as if at v0, whose
    # slots are spent ((1 + 0 + 1) * 8 = 12 + 4), not at v1 (8 more)
    assert coordinator.gate.capacity(version=0) == 0 and coordinator.gate.capacity(version=1) == 8
    assert not coordinator.try_admit("gen-0", 0, 4, version=1)


def test_a_killed_generator_finishing_late_changes_nothing(job_gate):
    """ray.kill is asynchronous: a killed generator's finish may land after its release. Its
    incarnation is released for good: the late finish frees nothing twice and raises nothing,
    and the replacement under the same id (the next incarnation) keeps books of its own."""
    coordinator, _, _ = job_gate
    assert coordinator.try_admit("gen-0", 0, 4, version=0) and coordinator.try_admit("gen-0", 0, 4, version=0)
    assert coordinator.release("gen-0", 0) == 8
    coordinator.finish("gen-0", 0, 4)  # late, from the killed incarnation
    assert not coordinator.try_admit("gen-0", 0, 4, version=0)  # nor is it admitted again
    assert coordinator.release("gen-0", 0) == 0
    assert coordinator.try_admit("gen-0", 1, 4, version=0)  # the replacement
    assert coordinator.gate.running == 4 and coordinator.running[("gen-0", 1)] == 4
    coordinator.finish("gen-0", 1, 4)
    assert coordinator.gate.running == 0 and coordinator.release("gen-0", 1) == 0


def test_duplicate_and_foreign_entries_free_no_slot_they_did_not_hold(job_gate, redis_client, stream_name):
    coordinator, producer, learner = job_gate
    producer.put([make_group(0), make_group(1), make_group(0)])  # a copy of group-0
    for junk in (b"garbage", encode(make_group(5))):  # another client's, with our fields
        redis_client.xadd(stream_name, {b"t": junk, b"p": b"gen-0"})
    got = learner.get(10, block_ms=0)  # the foreign ones are dead-lettered here
    copies = learner.duplicates(got)
    learner.ack(copies, reason="duplicate")
    assert coordinator.try_admit("gen-0", 0, 4, version=0)
    # the two groups left untrained hold their 8 slots; the copy held and freed its own
    assert coordinator.gate.accepted == 8 and coordinator.gate.capacity(version=0) == 16 - 8 - 4
    assert learner.accounting().lost == 0


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_simulated_pipeline_progresses_with_little_waste(k):
    """Generators at different speeds with lagging weights, rewards that sometimes fail, and a
    learner that trains batches in order and drops what is older than k (as the real one does):
    the job never stalls and the gate keeps the dropped share small."""
    rng = random.Random(k)
    batch, n = 8, 4
    gate = StalenessGate(max_staleness=k, batch_size=batch)
    learner_version = 0
    gens = [{"version": 0, "inflight": None} for _ in range(3)]
    queue: list[int] = []  # versions of accepted samples, in order
    trained = dropped = 0
    for _ in range(5000):
        g = rng.choice(gens)
        action = rng.random()
        if action < 0.3 and g["version"] < learner_version:  # weights arrive, maybe late
            g["version"] = learner_version
        elif action < 0.7:
            if g["inflight"] is None and gate.try_admit(n, g["version"]):
                g["inflight"] = g["version"]
            elif g["inflight"] is not None:
                accepted = n - (rng.random() < 0.1)  # sometimes a reward fails
                queue.extend([g["inflight"]] * accepted)
                gate.finish(n, accepted)
                g["inflight"] = None
        else:  # learner: drop the stale, train a full batch when there is one
            fresh = [v for v in queue if learner_version - v <= k]
            gate.forget(len(queue) - len(fresh))
            dropped += len(queue) - len(fresh)
            queue = fresh
            if len(queue) >= batch:
                queue = queue[batch:]
                trained += batch
                learner_version += 1
    assert learner_version > 100, "the pipeline stalled"
    print(f"k={k}: {learner_version} versions, dropped {dropped}/{trained + dropped}")
    assert dropped <= 0.15 * (trained + dropped)


def test_bad_calls_are_rejected():
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        StalenessGate(max_staleness=-1, batch_size=4)
    gate = StalenessGate(max_staleness=1, batch_size=4)
    with pytest.raises(ValueError, match="finished once"):
        gate.finish(4, 4)
    with pytest.raises(ValueError, match="forget"):
        gate.forget(1)


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("max_reuse", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_nothing_admitted_goes_stale_while_the_learner_keeps_pace(k, max_reuse, uneven):
    """Generators faster than the learner, weights that reach them late, the real gate and the
    real replay (oldest group first), a learner that collects and trains as learners.learner
    does (drawing what is there each tick until its batch is full, re-using what replay allows,
    reporting fresh samples and drops back to the gate as the launcher does): every group the
    gate admitted is trained, none dropped stale. With uneven generation times (1-3 ticks) a
    group can finish after groups admitted behind it, and at k = 1 a few (under 0.1%) then
    arrive one version too old: the learner's drop rule is what catches those."""
    from buffer.replay import StalenessReplay
    from helpers import make_group

    from async_rlhf.types import Received

    rng = random.Random(f"{k}/{max_reuse}")
    group_size, groups_per_batch, need = 4, 2, 4  # learner batch: 4 groups of 4 samples
    gate = StalenessGate(max_staleness=k, batch_size=need * group_size)
    replay = StalenessReplay(max_reuse=max_reuse, max_staleness=k)
    stream: list[Received] = []
    gens = [{"version": 0, "busy": 0, "inflight": None} for _ in range(3)]
    version, items, fresh, made, stale, trained, busy_until = 0, [], set(), 0, 0, 0, 0
    for tick in range(20_000):
        for g in gens:
            if g["version"] < version and rng.random() < 0.5:  # weights arrive, maybe late
                g["version"] = version
            g["busy"] -= 1
            if g["inflight"] is not None and g["busy"] <= 0:
                for _ in range(groups_per_batch):
                    stream.append(Received(f"{made}-0", make_group(made, group_size, policy_version=g["inflight"])))
                    made += 1
                gate.finish(groups_per_batch * group_size, groups_per_batch * group_size)
                g["inflight"] = None
            if g["inflight"] is None and gate.try_admit(groups_per_batch * group_size, g["version"]):
                g["inflight"], g["busy"] = g["version"], rng.randint(1, 3) if uneven else 2
        if tick < busy_until:  # the learner: training its last batch
            continue
        replay.add(stream)  # collecting: draws each tick what is there, re-using what replay allows
        stream = []
        draw = replay.draw(need - len(items), version)
        stale += len(draw.dropped)
        gate.forget(len(draw.dropped) * group_size)
        items += draw.items
        fresh.update(draw.first_use)
        if len(items) == need:
            gate.step_trained(sum(r.entry_id in fresh for r in items) * group_size)
            trained += len(fresh & {r.entry_id for r in items})
            items, fresh, version, busy_until = [], set(), version + 1, tick + 3
    assert version > 500, "the pipeline stalled"
    assert stale <= (0.001 * made if uneven else 0), f"{stale} of {made} admitted groups dropped stale"
    assert trained + stale >= made - (k + 2) * need  # all but the last few in flight
