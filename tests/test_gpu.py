"""The GPU paths, chosen by device with the same code shape as the CPU ones: NCCL weight
broadcast, the bucket format, the learner step (flash-attention 2 where installed) and ZeRO-3,
the transformers engine. Marked `gpu`: skipped on a machine without CUDA (tests/conftest.py),
run as they are where one is lent. This module imports only torch, transformers and the project's
floor at its top: a GPU machine with those alone collects it, and each test that needs more
(DeepSpeed, flash-attn, a second GPU) is skipped naming what is missing."""

import math
import multiprocessing as mp
import os
import signal

import pytest
import torch

from async_rlhf.config import LearnerConfig
from async_rlhf.weight_sync import WeightBroadcaster, WeightReceiver, pack, unpack

pytestmark = pytest.mark.gpu
_NO_DEEPSPEED = "DeepSpeed is not installed: pip install deepspeed==0.19.8 (DS_BUILD_OPS=0; its wheel is pure Python)"


def _deepspeed_backend():
    pytest.importorskip("deepspeed", reason=_NO_DEEPSPEED)
    import learners.deepspeed_backend as ds_backend

    return ds_backend


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("embed.weight", torch.randn(37, 11, generator=g)),
            ("norm.weight", torch.randn(7, generator=g).to(torch.bfloat16))]


def _summary(named_tensors) -> list[tuple]:
    return [(n, t.dtype, tuple(t.shape), round(t.float().sum().item(), 3)) for n, t in named_tensors]


def _member_on_gpu(index, commands, results):
    torch.cuda.set_device(index)  # NCCL wants one GPU per member; ipc shares the learner's
    receiver = WeightReceiver(*commands.get(timeout=60))  # NCCL: joins, the group forms eagerly
    update = receiver.receive(commands.get(timeout=60))
    results.put((update.version, str(update.named_tensors[0][1].device), _summary(update.named_tensors)))
    receiver.close()


def _one_update(sender, weights, version: int, gpu: int) -> tuple:
    """`weights` published as `version` before a member on GPU `gpu` joins: what it received."""
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    member = ctx.Process(target=_member_on_gpu, args=(gpu, commands, results), daemon=True)
    member.start()
    sender.publish(weights, version=version)  # kept until the group forms

    def notify(meta):
        commands.put(meta)
        return lambda: None

    commands.put((sender.open_epoch(2, notify), 1))
    got = results.get(timeout=120)
    sender.close()
    member.join(30)
    return got


def test_nccl_broadcast_reaches_a_member_on_another_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL needs a GPU per member: {torch.cuda.device_count()} here")
    sender = WeightBroadcaster(timeout_s=60)
    assert sender.backend == "nccl"  # chosen by device
    assert _one_update(sender, _weights(4), 4, gpu=1) == (4, "cuda:1", _summary(_weights(4)))


def test_colocated_weights_pass_by_cuda_ipc_and_never_leave_the_gpu():
    """placement: colocated on one GPU: the learner packs each update into device memory that a
    member process on the same GPU opens by its CUDA IPC handle; no host bucket, no NCCL."""
    sender = WeightBroadcaster(backend="ipc", timeout_s=60)
    weights = [(n, t.cuda()) for n, t in _weights(5)]
    assert _one_update(sender, weights, 5, gpu=0) == (5, "cuda:0", _summary(_weights(5)))
    assert all(b.device.type == "cuda" for b in sender._last[2])


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
    sender.publish(_weights(1), version=1)  # handed to the sender thread, which meets the dead member
    with sender._state:
        assert sender._state.wait_for(lambda: sender.failures, 60)
    assert sender.failures == 1 and "version 1 in epoch 1 failed" in sender.last_error
    sender.close()


def test_buckets_are_cast_on_the_gpu_and_unpack_on_it():
    """The bucket format with CUDA tensors: cast to bf16 on the GPU, one host bucket each within
    the budget, unpacked back onto the GPU as the cast tensors."""
    weights = [(n, t.cuda()) for n, t in _weights(3)] + [("big", torch.randn(4096, device="cuda"))]
    metas, buckets = pack(weights, 1024, torch.bfloat16)
    assert all(b.device.type == "cpu" and (b.numel() <= 1024 or len(m) == 1) for m, b in zip(metas, buckets))
    got = [pair for m, b in zip(metas, buckets) for pair in unpack(m, b.cuda())]
    assert [(n, t.dtype, t.device.type) for n, t in got] == [(n, torch.bfloat16, "cuda") for n, _ in weights]
    assert all(torch.equal(a, b.to(torch.bfloat16)) for (_, a), (_, b) in zip(got, weights))


def test_bf16_learner_step_on_the_gpu(tiny_actor_model):
    """ZeRO-0 with bf16 autocast on CUDA trains; attention is flash-attention 2 where flash-attn is
    installed (the `flash` extra), SDPA otherwise."""
    import importlib.util

    backend = _deepspeed_backend().DeepSpeedBackend(LearnerConfig(batch_size=4, micro_batch=4, lr=1e-3),
                                                    str(tiny_actor_model), dtype="bfloat16")
    assert backend.device.startswith("cuda")
    flash = importlib.util.find_spec("flash_attn") is not None
    assert backend.engine.module.config._attn_implementation == ("flash_attention_2" if flash else "sdpa")
    ids = torch.randint(4, 50, (4, 12), device=backend.device)
    positions = torch.arange(5, 11, device=backend.device).expand(4, -1)
    before = [p.detach().clone() for p in backend.engine.module.parameters()]
    logp, _ = backend.logprobs(ids, torch.ones_like(ids), positions)
    backend.backward(-logp.float().mean())
    assert math.isfinite(backend.step())
    assert any(not torch.equal(a, b) for a, b in zip(before, backend.engine.module.parameters()))


def test_hf_engine_samples_and_loads_weights_on_the_gpu(tiny_actor_model):
    from transformers import AutoModelForCausalLM

    from actors.engines.hf_engine import HFEngine
    from async_rlhf.types import Prompt

    engine = HFEngine(tiny_actor_model, max_new_tokens=6)
    assert engine.device == "cuda"
    (group,) = engine.generate([Prompt("p", (5, 6, 7), "", "")], n=2)
    assert len(group) == 2 and all(len(s.response_ids) >= 1 for s in group)
    state = AutoModelForCausalLM.from_pretrained(tiny_actor_model).state_dict()
    engine.update_weights(((k, 2 * v) for k, v in state.items()), version=1)
    embed = engine.model.model.embed_tokens.weight
    assert engine.policy_version == 1 and embed.is_cuda and torch.equal(embed.cpu(), 2 * state["model.embed_tokens.weight"])


def test_zero3_builds_partitioned_trains_in_bf16_and_gathers_zero0s_weights(tiny_actor_model, monkeypatch):
    """ZeRO-3 on a GPU: the policy is built partitioned (never whole on the GPU), a bf16-autocast
    step trains it, and before that step its gathered weights are ZeRO-0's, name for name."""
    import dataclasses

    ds_backend = _deepspeed_backend()

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
