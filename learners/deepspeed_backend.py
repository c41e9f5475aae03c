"""DeepSpeed train backend: policy engine, optional frozen reference and critic, weight gather.

One instance per data-parallel rank (the launcher starts `ranks` processes with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; a lone process needs none of them). gloo on CPU,
NCCL on GPU, chosen by device. ZeRO stage 0-3 from LearnerConfig; fp32 or bf16 weights from
ModelConfig, and with fp32 weights forward passes under bf16 autocast per learner.mixed_precision
(DeepSpeed's `torch_autocast`: fp32 weights, gradients and optimizer).

Gradient scaling: the losses handed to `backward` are already a rank's share of the global loss
(normalised by GLOBAL token/sequence counts, see learners/losses.py), so we undo DeepSpeed's
division by gradient-accumulation steps (scale_wrt_gas=False) and multiply by the world size to
undo its data-parallel averaging: the summed gradient is then the full batch's, whatever the split.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from async_rlhf.config import LearnerConfig
from async_rlhf.procs import RENDEZVOUS_KEY, free_port
from learners.checkpoints import mark_latest
from learners.models import DTYPES, HeldModels, adamw, autocast_dtype, default_device, load_models


# Elements per gradient-communication bucket (200 MB in float32), at every ZeRO stage
BUCKET_ELEMENTS = 50_000_000


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "deepspeed is not installed: `DS_BUILD_OPS=0 pip install deepspeed==0.19.8`"
        ) from e
    return deepspeed


def init_distributed(device: str) -> tuple[int, int]:
    """Join (or create, for a lone process) the learner's process group; returns (rank, world).

    On CPU, DeepSpeed's TorchBackend would JIT-compile its shared-memory all-reduce op
    (`deepspeed_shm_comm`, ~75-120 s) the first time; it only builds ops that
    `deepspeed.ops.__compatible_ops__` marks compatible, so we mark it not: gloo all-reduces
    instead. (That dict is probed lazily on first access, which we also skip this way.)

    With $ASYNC_RLHF_RENDEZVOUS_KEY set (the launcher's ranks), the group's keys live under that
    secret in the MASTER_ADDR:MASTER_PORT store, which listens on every interface: a process
    that reaches the port without the key cannot take a rank.
    """
    deepspeed = _import_deepspeed()
    if "RANK" not in os.environ:  # a lone process: a one-member group on loopback
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not torch.distributed.is_initialized() and (key := os.environ.get(RENDEZVOUS_KEY)):
        env = os.environ
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        store = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                                           is_master=rank == 0)
        # device_id as DeepSpeed sets it on CUDA (its init sees this group and keeps it)
        device_id = torch.device("cuda", int(env["LOCAL_RANK"])) if backend == "nccl" else None
        torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore(key, store),
                                             rank=rank, world_size=world, device_id=device_id)
    if not deepspeed.comm.is_initialized():
        deepspeed.ops.__dict__.setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


@contextlib.contextmanager
def zero3_init(ds_config: dict[str, Any]) -> Iterator[None]:
    """Hugging Face models built here (`from_pretrained`) are ZeRO-3 partitioned as they are
    built (deepspeed.zero.Init, on the device), and their checkpoint is copied in one layer at a
    time: no rank builds the whole model. Transformers finds the config through a weak
    reference to its HfDeepSpeedConfig, as its Trainer sets it up."""
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    held = HfDeepSpeedConfig(ds_config)  # noqa: F841 - alive while the models are built
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


class DeepSpeedBackend(HeldModels):
    """Policy (trained), frozen reference (when kl_coef > 0), critic (when advantage == 'gae').

    `policy` is an HF model directory or an already built causal LM (benchmarks). All ranks
    must call the collective methods (step, full_state_dict, save/load) together.
    """

    def __init__(
        self,
        cfg: LearnerConfig,
        policy: str | nn.Module,
        *,
        dtype: str = "float32",
        temperature: float = 1.0,
        seed: int = 0,
    ):
        deepspeed = _import_deepspeed()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}: use the generators' one")
        self.cfg = cfg
        self.temperature = temperature
        self.device = default_device()
        if self.device != "cpu":
            torch.cuda.set_device(self.device)
        self.rank, self.world_size = init_distributed(self.device)
        if cfg.ranks != self.world_size:
            raise ValueError(
                f"learner.ranks ({cfg.ranks}) differs from the process group size "
                f"({self.world_size}): start learner.ranks processes, or set learner.ranks="
                f"{self.world_size}"
            )
        torch.manual_seed(seed)
        self.dtype = DTYPES[dtype]
        self.autocast = autocast_dtype(cfg.mixed_precision, self.device, self.dtype)
        # ZeRO-3 on GPU: built partitioned. Otherwise DeepSpeed moves each whole model onto every
        # GPU before it partitions it (its engine's _configure_distributed_model). On CPU,
        # transformers maps the checkpoint lazily and the ranks share its pages: built
        # partitioned, a 271M model loaded slower and peaked higher there (design.md)
        zero3_gpu = cfg.zero_stage == 3 and self.device != "cpu"
        models = load_models(cfg, policy, self.device, self.dtype,
                             sharded=functools.partial(zero3_init, self._ds_config()) if zero3_gpu
                             else contextlib.nullcontext)
        self.model, self.reference = models.policy, models.reference
        self.engine, *_ = deepspeed.initialize(
            model=models.policy,
            optimizer=self._optimizer(models.policy.parameters(), cfg.lr),
            config=self._ds_config(),
        )
        self.critic = None
        if models.critic is not None:
            self.critic, *_ = deepspeed.initialize(
                model=models.critic,
                optimizer=self._optimizer(models.critic.parameters(), cfg.critic_lr),
                config=self._ds_config(),
            )
        self.run_policy = self.engine
        for engine in (self.engine, self.critic):
            if engine is not None and cfg.zero_stage == 0:
                engine.enable_backward_allreduce = False  # backward() reduces, in smaller buckets

    # -- setup -----------------------------------------------------------------------------
    def _optimizer(self, params, lr: float):
        if self.cfg.optimizer == "adamw_torch":
            return adamw(params, lr, self.cfg.weight_decay)
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # C++ build on first use

        if self.device != "cpu":
            return FusedAdam(params, lr=lr, weight_decay=self.cfg.weight_decay, adam_w_mode=True)
        return DeepSpeedCPUAdam(params, lr=lr, weight_decay=self.cfg.weight_decay, adamw_mode=True)

    def _ds_config(self) -> dict[str, Any]:
        cfg = self.cfg
        per_step = cfg.batch_size // cfg.minibatches
        return {
            "train_batch_size": per_step,
            "train_micro_batch_size_per_gpu": cfg.micro_batch,
            "gradient_accumulation_steps": per_step // (cfg.micro_batch * self.world_size),
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": self._zero_config(),
            "bf16": {"enabled": self.dtype == torch.bfloat16},
            # the engine's forward keeps our autocast only when it is configured here too
            # (deepspeed/runtime/torch_autocast.py autocast_if_enabled turns an outer one off);
            # no "lower precision safe" modules: gradients are reduced in float32, not bf16
            "torch_autocast": {"enabled": self.autocast is not None, "dtype": "bfloat16",
                               "lower_precision_safe_modules": []},
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,  # offloaded states step with torch's AdamW too
            "steps_per_print": 1 << 30,
        }

    def _zero_config(self) -> dict[str, Any]:
        """ZeRO's section: the stage, its offloads, and communication buckets of BUCKET_ELEMENTS
        (DeepSpeed's default, 500M, makes a 2 GB float32 buffer on every rank)."""
        cfg, pin = self.cfg, self.device != "cpu"
        zero: dict[str, Any] = {"stage": cfg.zero_stage}
        if cfg.zero_stage:
            zero.update(reduce_bucket_size=BUCKET_ELEMENTS, allgather_bucket_size=BUCKET_ELEMENTS)
        if cfg.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if cfg.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        return zero

    # -- forward / backward ----------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, critic: bool = False) -> None:
        """Back-propagate a rank's share of the global loss (see module docstring). At ZeRO-0 the
        gradients are all-reduced here at the accumulation boundary, in buckets of BUCKET_ELEMENTS:
        DeepSpeed's own reduction flattens them into buckets of 500M elements, a whole float32
        copy of a 0.5B model's gradients (2 GB a rank), even with one rank, where none is needed."""
        engine = self.critic if critic else self.engine
        engine.backward(loss * self.world_size, scale_wrt_gas=False)
        if self.cfg.zero_stage == 0 and self.world_size > 1 and engine.is_gradient_accumulation_boundary():
            engine.allreduce_gradients(bucket_size=BUCKET_ELEMENTS)

    def step(self, *, critic: bool = False) -> float | None:
        """Optimizer step at the accumulation boundary (no-op otherwise); returns the grad norm there.

        A non-finite norm means the step was skipped: no weight or optimizer state changed, the
        accumulated gradients are dropped, on every rank alike (the norm is global). DeepSpeed
        does this itself under ZeRO 1-3 and in its bf16 optimizers (DeepSpeedZeroOptimizer.step,
        DeepSpeedZeroOptimizer_Stage3.step, BF16_Optimizer.step, FP16_UnfusedOptimizer.step: on
        an invalid norm they zero the grads, return before the inner optimizer, report inf).
        ZeRO-0 in fp32 hands the grads straight to the torch optimizer, so we skip here.
        """
        engine = self.critic if critic else self.engine
        boundary = engine.is_gradient_accumulation_boundary()
        own_norm = None
        if boundary and self.cfg.zero_stage == 0 and self.dtype == torch.float32:
            # ZeRO-0 fp32 clips without keeping the norm; grads are all-reduced by now
            grads = [p.grad.detach().norm() for p in engine.module.parameters() if p.grad is not None]
            own_norm = float(torch.stack(grads).norm()) if grads else 0.0
            if not math.isfinite(own_norm):
                # drop the grads and close the accumulation window as engine.step() would
                # (its last act is micro_steps += 1), without the step: its fp32 clipping
                # (runtime/utils.py clip_grad_norm_) fails when no parameter has a gradient
                engine.zero_grad()
                engine.micro_steps += 1
                return own_norm
        engine.step()
        if not boundary:
            return None
        norm = engine.get_global_grad_norm()
        return own_norm if norm is None else float(norm)

    def set_lr(self, lr: float) -> None:
        """Every wrapper DeepSpeed puts around our optimizer (ZeRO 1-3, bf16) shares its
        param_groups: the lr set here is the one its step uses."""
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    # -- weights ---------------------------------------------------------------------------
    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor on the learner's device) for every policy parameter, each valid
        until the next is asked for (no copy; ZeRO-3 shards gathered one parameter at a time).
        Collective: every rank must iterate to the end; only rank 0's tensors are meaningful
        (others get empty ones at ZeRO-3)."""
        deepspeed = _import_deepspeed()
        for name, p in self.engine.module.named_parameters():
            if self.cfg.zero_stage == 3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    yield name, p.data.detach() if self.rank == 0 else torch.empty(0)
            else:
                yield name, p.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All policy weights on rank 0, copied to CPU ({} elsewhere). Collective."""
        weights = {name: t.to("cpu", copy=True) for name, t in self.named_full_weights()}
        return weights if self.rank == 0 else {}

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """HF export of the policy (rank 0 writes; collective)."""
        weights = self.full_state_dict()
        if self.rank == 0:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            self.engine.module.save_pretrained(out_dir, state_dict=weights)
        torch.distributed.barrier()

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, ckpt_dir: str | os.PathLike, tag: str, client_state: dict) -> None:
        """DeepSpeed checkpoint (weights, optimizer, ZeRO shards) + client_state, the critic's
        beside it. Collective. `latest` names the tag only once every rank has written its part:
        DeepSpeed's own rank 0 writes it without waiting for the others, so a rank that died or
        hung mid-write would leave a `latest` that cannot load."""
        if self.critic is not None:  # loaded by the policy's tag: it needs no `latest` of its own
            self.critic.save_checkpoint(str(Path(ckpt_dir) / "critic"), tag=tag, save_latest=False)
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
        if self.rank == 0:  # DeepSpeed's save ends in a barrier: every rank's files are written
            mark_latest(ckpt_dir, tag)
        torch.distributed.barrier()

    def load_checkpoint(self, ckpt_dir: str | os.PathLike) -> dict | None:
        """Load the latest checkpoint in ckpt_dir; its client_state, or None if there is none."""
        latest = Path(ckpt_dir) / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
        path, client_state = self.engine.load_checkpoint(str(ckpt_dir), tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {ckpt_dir}")
        if self.critic is not None:
            self.critic.load_checkpoint(str(Path(ckpt_dir) / "critic"), tag=tag)
        return client_state
