"""The GPU paths, chosen by device with the same code shape as the CPU ones: NCCL weight
broadcast, flash-attention 2 and ZeRO-3 in the learner. Marked `gpu`: skipped on a machine without CUDA
(tests/conftest.py), run as they are where one is lent."""

import math
import multiprocessing as mp
import os
import signal

import pytest
import torch

from async_rlhf.config import LearnerConfig
from async_rlhf.weight_sync import WeightBroadcaster, WeightReceiver

pytestmark = pytest.mark.gpu


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("embed.weight", torch.randn(37, 11, generator=g)),
            ("norm.weight", torch.randn(7, generator=g).to(torch.bfloat16))]


def _summary(named_tensors) -> list[tuple]:
    return [(n, t.dtype, tuple(t.shape), round(t.float().sum().item(), 3)) for n, t in named_tensors]


def _member_on_gpu_1(commands, results):
    torch.cuda.set_device(1)  # NCCL wants one GPU per member
    receiver = WeightReceiver(*commands.get(timeout=60))  # joins: the group forms eagerly
    update = receiver.receive(commands.get(timeout=60))
    results.put((update.version, str(update.named_tensors[0][1].device), _summary(update.named_tensors)))
    receiver.close()


def test_nccl_broadcast_reaches_a_member_on_another_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL needs a GPU per member: {torch.cuda.device_count()} here")
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    member = ctx.Process(target=_member_on_gpu_1, args=(commands, results), daemon=True)
    member.start()
    sender = WeightBroadcaster(timeout_s=60)
    assert sender.backend == "nccl"  # chosen by device
    sender.publish(_weights(4), version=4)  # kept until the group forms

    def notify(meta):
        commands.put(meta)
        return lambda: None

    commands.put((sender.open_epoch(2, notify), 1))
    version, device, got = results.get(timeout=120)
    assert (version, device) == (4, "cuda:1") and got == _summary(_weights(4))
    sender.close()
    member.join(30)


def _member_that_dies_on_gpu_1(commands):
    torch.cuda.set_device(1)
    WeightReceiver(*commands.get(timeout=60))
    os.kill(os.getpid(), signal.SIGKILL)  # joined, then dead before the first update


def test_nccl_member_death_is_a_counted_failure_not_the_learners():
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=2 and blocking wait: the broadcast to a dead member
    raises in the sender (after the timeout) instead of the watchdog ending this process."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL needs a GPU per member: {torch.cuda.device_count()} here")
    ctx = mp.get_context("spawn")
    commands = ctx.Queue()
    member = ctx.Process(target=_member_that_dies_on_gpu_1, args=(commands,), daemon=True)
    member.start()
    sender = WeightBroadcaster(timeout_s=10)
    commands.put((sender.open_epoch(2, lambda meta: lambda: None), 1))
    with sender._state:
        sender._state.wait_for(lambda: sender._current.group is not None, 60)
    member.join(60)
    assert not sender.publish(_weights(1), version=1)
    assert sender.failures == 1 and "version 1 in epoch 1 failed" in sender.last_error
    sender.close()


def test_bf16_learner_uses_flash_attention_and_trains(tiny_actor_model):
    pytest.importorskip("flash_attn")
    from learners.deepspeed_backend import DeepSpeedBackend

    backend = DeepSpeedBackend(LearnerConfig(batch_size=4, micro_batch=4, lr=1e-3),
                               str(tiny_actor_model), dtype="bfloat16")
    assert backend.device.startswith("cuda")
    assert backend.engine.module.config._attn_implementation == "flash_attention_2"
    ids = torch.randint(4, 50, (4, 12), device=backend.device)
    positions = torch.arange(5, 11, device=backend.device).expand(4, -1)
    before = [p.detach().clone() for p in backend.engine.module.parameters()]
    logp, _ = backend.logprobs(ids, torch.ones_like(ids), positions)
    backend.backward(-logp.float().mean())
    assert math.isfinite(backend.step())
    assert any(not torch.equal(a, b) for a, b in zip(before, backend.engine.module.parameters()))


def test_zero3_builds_partitioned_trains_in_bf16_and_gathers_zero0s_weights(tiny_actor_model, monkeypatch):
    """ZeRO-3 on a GPU: the policy is built partitioned (never whole on the GPU), a bf16-autocast
    step trains it, and before that step its gathered weights are ZeRO-0's, name for name."""
    import dataclasses

    import learners.deepspeed_backend as ds_backend

    partitioned = []
    load_models = ds_backend.load_models

    def recorded(*args, **kwargs):
        models = load_models(*args, **kwargs)
        partitioned.append(all(hasattr(p, "ds_tensor") and p.numel() == 0 for p in models.policy.parameters()))
        return models

    monkeypatch.setattr(ds_backend, "load_models", recorded)
    cfg = LearnerConfig(batch_size=4, micro_batch=4, lr=1e-3, zero_stage=3)
    zero3 = ds_backend.DeepSpeedBackend(cfg, str(tiny_actor_model))
    zero0 = ds_backend.DeepSpeedBackend(dataclasses.replace(cfg, zero_stage=0), str(tiny_actor_model))
    assert partitioned == [True, False] and zero3.autocast == torch.bfloat16
    gathered, whole = zero3.full_state_dict(), zero0.full_state_dict()
    assert list(gathered) == list(whole) and all(torch.equal(gathered[k], whole[k]) for k in whole)
    ids = torch.randint(4, 50, (4, 12), device=zero3.device)
    logp, _ = zero3.logprobs(ids, torch.ones_like(ids), torch.arange(5, 11, device=zero3.device).expand(4, -1))
    zero3.backward(-logp.float().mean())
    assert math.isfinite(zero3.step())
    assert any(not torch.equal(gathered[k], v) for k, v in zero3.full_state_dict().items())
