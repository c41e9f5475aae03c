"""StalenessReplay: reuse limit, staleness eviction, draw order, and what the learner must ack."""

import dataclasses

import numpy as np
import pytest

from async_rlhf.types import Group, Received
from buffer.replay import StalenessReplay
from helpers import make_group


def item(entry_id: str, policy_version: int) -> Received:
    """A group of 2 generated with `policy_version`, as entry `entry_id`."""
    return Received(entry_id, make_group(size=2, policy_version=policy_version))


def ids(items) -> list[str]:
    return [r.entry_id for r in items]


def test_single_use_on_policy():
    buf = StalenessReplay(max_reuse=1, max_staleness=0)
    buf.add([item("a", 0), item("b", 0), item("c", 0)])
    draw = buf.draw(2, version=0)
    assert ids(draw.items) == ["a", "b"] and draw.first_use == ["a", "b"] and draw.dropped == []
    assert len(buf) == 1 and buf.evicted["reuse_spent"] == 2
    draw = buf.draw(2, version=0)
    assert ids(draw.items) == ["c"] and len(buf) == 0


def test_too_stale_before_use_is_dropped_with_reason():
    buf = StalenessReplay(max_reuse=1, max_staleness=2)
    buf.add([item("old", 0), item("edge", 1), item("new", 3)])
    draw = buf.draw(10, version=3)  # staleness 3, 2, 0
    assert draw.dropped == [("old", "dropped_stale")]
    assert sorted(ids(draw.items)) == ["edge", "new"]
    assert buf.evicted["dropped_stale"] == 1


def test_reuse_up_to_max_then_evicted_and_only_first_use_reported():
    buf = StalenessReplay(max_reuse=3, max_staleness=10)
    buf.add([item("a", 0)])
    first = buf.draw(1, version=0)
    assert first.first_use == ["a"]
    for version in (1, 2):  # once per learner version
        again = buf.draw(1, version=version)
        assert ids(again.items) == ["a"] and again.first_use == []
    assert len(buf) == 0 and buf.draw(1, version=3).items == []


def test_stale_after_use_is_evicted_silently():
    buf = StalenessReplay(max_reuse=5, max_staleness=1)
    buf.add([item("a", 0)])
    buf.draw(1, version=0)
    draw = buf.draw(1, version=2)
    assert draw.items == [] and draw.dropped == []  # already acked as trained on first use
    assert buf.evicted["stale_after_use"] == 1 and len(buf) == 0


def test_least_used_then_oldest_then_first_come():
    buf = StalenessReplay(max_reuse=4, max_staleness=10)
    buf.add([item("v2", 2), item("v1-first", 1), item("v1-second", 1)])
    assert ids(buf.draw(1, version=2).items) == ["v1-first"]
    assert ids(buf.draw(2, version=3).items) == ["v1-second", "v2"]  # unused before used
    buf.add([item("v0", 0)])
    assert ids(buf.draw(1, version=4).items) == ["v0"]  # unused first
    assert ids(buf.draw(3, version=5).items) == ["v0", "v1-first", "v1-second"]  # all used once


def test_an_older_group_is_served_before_a_newer_one():
    """Oldest first, as the staleness gate assumes: a newer group arriving first does not push
    an older one back until it goes stale and is dropped untrained."""
    buf = StalenessReplay(max_reuse=1, max_staleness=1)
    buf.add([item("new", 1), item("old", 0)])
    first = buf.draw(1, version=1)
    assert ids(first.items) == ["old"] and first.first_use == ["old"]
    second = buf.draw(1, version=2)  # "old" would be stale now; it was trained in time
    assert ids(second.items) == ["new"] and second.dropped == []
    assert buf.evicted["dropped_stale"] == 0


def test_a_group_is_as_old_as_its_oldest_member():
    """Staleness and order act on whole groups, by the oldest member's version."""
    mixed = make_group(size=2, policy_version=3)
    mixed = Group((mixed.members[0], dataclasses.replace(mixed.members[1], policy_version=1)))
    buf = StalenessReplay(max_reuse=1, max_staleness=1)
    buf.add([item("v2", 2), Received("mixed", mixed)])
    assert ids(buf.draw(1, version=2).items) == ["mixed"]  # version 1: older than "v2"
    buf.add([Received("mixed-again", mixed)])
    draw = buf.draw(5, version=3)  # staleness 3 - 1 = 2 > 1: the whole group goes
    assert draw.dropped == [("mixed-again", "dropped_stale")] and ids(draw.items) == ["v2"]


def test_duplicate_ids_are_ignored():
    buf = StalenessReplay(max_reuse=2, max_staleness=0)
    buf.add([item("a", 0), item("a", 0)])
    assert len(buf) == 1 and buf.evicted["duplicate_ignored"] == 1


def test_every_added_id_is_accounted_for_exactly_once():
    """Across many steps: each id is acked exactly once, as first use or as dropped."""
    rng = np.random.default_rng(0)
    buf = StalenessReplay(max_reuse=2, max_staleness=1)
    acked: list[str] = []
    added = 0
    for version in range(30):
        new = [item(f"{version}-{i}", max(0, version - int(rng.integers(0, 3))))
               for i in range(int(rng.integers(0, 6)))]
        added += len(new)
        buf.add(new)
        draw = buf.draw(3, version)
        acked += draw.first_use + [entry_id for entry_id, _ in draw.dropped]
    leftover = buf.draw(10**6, version=10**6).dropped  # everything left becomes stale
    acked += [entry_id for entry_id, _ in leftover]
    assert len(acked) == len(set(acked)) == added


@pytest.mark.parametrize("kwargs", [{"max_reuse": 0}, {"max_staleness": -1}])
def test_bad_settings_name_the_value(kwargs):
    with pytest.raises(ValueError, match=str(list(kwargs.values())[0])):
        StalenessReplay(**kwargs)


def test_reused_items_are_drawn_once_per_version():
    """A step that draws twice while filling its batch never gets the same item twice."""
    replay = StalenessReplay(max_reuse=2, max_staleness=1)
    replay.add([item(str(i), 0) for i in range(16)])
    first = replay.draw(32, version=0)
    second = replay.draw(16, version=0)
    assert len(first.items) == 16 and second.items == []
    again = replay.draw(32, version=1)  # the next step may reuse them
    assert sorted(ids(again.items)) == sorted(ids(first.items))
