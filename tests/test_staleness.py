"""The staleness gate, checked by simulating generators and a learner that trains in order."""

import random

import pytest

from async_rlhf.staleness import StalenessGate


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


def test_resumed_gate_holds_the_slots_of_entries_carried_in_the_stream():
    from async_rlhf.launch.roles import Coordinator

    # Killed at version 0 with 128 samples in the stream (more than the gate's 40 slots):
    # nothing new is admitted while they come first, and dropping all of them is no error.
    coordinator = Coordinator(max_staleness=4, batch_size=8, start_version=0, carried=128)
    assert coordinator.gate.capacity(version=0) == 0
    assert not coordinator.try_admit("gen-0", 8, version=0)
    coordinator.forget(128)
    assert coordinator.gate.capacity(version=0) == 40  # (4 + 0 + 1) * 8
    resumed = Coordinator(max_staleness=1, batch_size=8, start_version=3, carried=5)
    assert resumed.gate.capacity(version=3) == (1 + 3 + 1) * 8 - (3 * 8 + 5)


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
