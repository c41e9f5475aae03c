"""Weight broadcast over real gloo process groups between real processes."""

import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from async_rlhf.weight_sync import WeightBroadcaster, WeightReceiver


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [
        ("embed.weight", torch.randn(37, 11, generator=g)),
        ("norm.weight", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd byte count
        ("empty", torch.empty(0)),
        ("lm_head.weight", torch.randn(300, 41, generator=g)),
    ]


def _member(addresses, results, rank_of, host="127.0.0.1"):
    """Join each epoch address from `addresses` until None, binding `host`; report what arrives."""
    while (address := addresses.get(timeout=60)) is not None:
        receiver = WeightReceiver(address, rank_of(address), timeout_s=60, host=host)
        while (update := receiver.receive()) is not None:
            results.put((address.epoch, update.version,
                         [(n, t.dtype, tuple(t.shape), t.float().sum().item()) for n, t in update.named_tensors]))
        results.put((address.epoch, "closed", None))


def _expected(version):
    return [(n, t.dtype, tuple(t.shape), t.float().sum().item()) for n, t in _weights(version)]


def _rank_1(address):
    return 1


def _rank_last(address):
    return address.world_size - 1


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


def test_versions_reach_every_member_across_epochs(ctx):
    sender = WeightBroadcaster(bucket_mb=0.01, timeout_s=60)  # 10 KB buckets: several per publish
    a_in, b_in, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    a = ctx.Process(target=_member, args=(a_in, out, _rank_1), daemon=True)
    a.start()
    sender.publish(_weights(1), version=1)  # no group yet: kept for whoever joins
    a_in.put(sender.open_epoch(world_size=2))
    assert out.get(timeout=60) == (1, 1, _expected(1))  # caught up as soon as the group formed
    assert sender.publish(_weights(2), version=2)
    assert out.get(timeout=60) == (1, 2, _expected(2))
    assert sender.last_publish_bytes > 0 and sender.last_publish_s > 0

    # A second generator joins: a new epoch with 3 members replaces the first, and both members
    # get the newest version at once.
    b = ctx.Process(target=_member, args=(b_in, out, _rank_last), daemon=True)
    b.start()
    address = sender.open_epoch(world_size=3)
    a_in.put(address)
    b_in.put(address)
    got = sorted((out.get(timeout=60) for _ in range(3)), key=str)
    assert got == sorted([(1, "closed", None), (2, 2, _expected(2)), (2, 2, _expected(2))], key=str)
    assert sender.publish(_weights(3), version=3)
    assert [out.get(timeout=60) for _ in range(2)] == [(2, 3, _expected(3))] * 2

    sender.close()
    assert sorted(out.get(timeout=60) for _ in range(2)) == [(2, "closed", None)] * 2
    a_in.put(None)
    b_in.put(None)
    a.join(30)
    b.join(30)


def test_member_that_never_joins_is_reported_and_publish_goes_on():
    sender = WeightBroadcaster(timeout_s=2)
    address = sender.open_epoch(world_size=2)
    assert not sender.publish(_weights(1), version=1)  # the group has not formed
    deadline = time.monotonic() + 30
    while sender.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sender.failures == 1
    assert f"not all 2 members joined 127.0.0.1:{address.port}" in sender.last_error


def test_publish_without_generators_consumes_the_iterator():
    sender = WeightBroadcaster()
    seen = []
    assert not sender.publish(((n, t) for n, t in _weights(1) if not seen.append(n)), version=1)
    assert len(seen) == 4


def _outsider(host, port, epoch, results):
    """Someone who reaches the store and knows the epoch, but was not given its key, tries to
    join as rank 1 under the epoch's plain prefix and take the weights."""
    store = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=10))
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"weights/epoch{epoch}", store), 1, 2,
                                      timedelta(seconds=5))
        header = torch.empty(4, dtype=torch.int64)
        group.broadcast([header], dist.BroadcastOptions()).wait()
        results.put(("joined", header.tolist()))
    except RuntimeError as e:
        results.put(("refused", str(e)[:200]))


def test_only_the_epochs_members_join_and_each_binds_its_own_address(ctx):
    """The store listens beyond loopback on a node that other nodes reach: an outsider who knows
    the address and epoch number does not get into the group, while a member given the epoch's
    key joins, its gloo device bound to its own address (127.0.0.3; the learner's 127.0.0.2)."""
    sender = WeightBroadcaster(host="127.0.0.2", timeout_s=60)
    sender.publish(_weights(1), version=1)
    address = sender.open_epoch(world_size=2)
    assert address.host == "127.0.0.2" and len(address.key) == 32
    out = ctx.Queue()
    outsider = ctx.Process(target=_outsider, args=(address.host, address.port, address.epoch, out))
    outsider.start()
    verdict, detail = out.get(timeout=60)
    assert verdict == "refused", detail
    outsider.join(30)

    member_in = ctx.Queue()
    member = ctx.Process(target=_member, args=(member_in, out, _rank_1, "127.0.0.3"), daemon=True)
    member.start()
    member_in.put(address)
    assert out.get(timeout=60) == (1, 1, _expected(1))
    sender.close()
    assert out.get(timeout=60) == (1, "closed", None)
    member_in.put(None)
    member.join(30)
