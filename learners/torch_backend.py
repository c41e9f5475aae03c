"""Plain torch train backend: one process, the policy (and critic) on torch.optim.AdamW.

No process group and no DeepSpeed: world size 1, float32 weights (forward passes under bf16
autocast per learner.mixed_precision), on the GPU where CUDA is and the CPU otherwise; the
learner loop's tests run on it in seconds. Its steps are DeepSpeed ZeRO-0's on one rank: the
micro-batches' loss shares' gradients summed (no division by the accumulation count), clipped to
learner.grad_clip, one AdamW step per learner.batch_size / learner.minibatches samples, and a
non-finite gradient norm drops the step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from async_rlhf.config import LearnerConfig
from learners.checkpoints import mark_latest
from learners.models import HeldModels, adamw, autocast_dtype, default_device, load_models

_STATE = "state.pt"


class TorchBackend(HeldModels):
    """Policy (trained), frozen reference (when kl_coef > 0), critic (when advantage == 'gae').

    `policy` is an HF model directory or an already built causal LM (tests, benchmarks).
    """

    rank, world_size = 0, 1

    def __init__(self, cfg: LearnerConfig, policy: str | nn.Module, *, dtype: str = "float32",
                 temperature: float = 1.0, seed: int = 0):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}: use the generators' one")
        if cfg.ranks != 1:
            raise ValueError(f"learner.ranks ({cfg.ranks}) must be 1 with the torch backend (one "
                             "process): set learner.ranks=1, or use the DeepSpeed backend for several")
        if dtype != "float32":
            raise ValueError(f"the torch backend trains in float32, got model.dtype={dtype}: set "
                             "model.dtype=float32, or use the DeepSpeed backend for bfloat16")
        if cfg.optimizer != "adamw_torch":
            raise ValueError(f"learner.optimizer={cfg.optimizer} needs DeepSpeed: the torch backend "
                             "runs torch.optim.AdamW (learner.optimizer=adamw_torch)")
        self.cfg, self.temperature = cfg, temperature
        self.device = default_device()
        self.autocast = autocast_dtype(cfg.mixed_precision, self.device, torch.float32)
        torch.manual_seed(seed)
        models = load_models(cfg, policy, self.device, torch.float32)
        self.model = self.run_policy = models.policy.to(self.device).train()
        self.reference = models.reference
        self.critic = None if models.critic is None else models.critic.to(self.device)
        self._optimizers = {"policy": adamw(self.model.parameters(), cfg.lr, cfg.weight_decay)}
        if self.critic is not None:
            self._optimizers["critic"] = adamw(self.critic.parameters(), cfg.critic_lr, cfg.weight_decay)
        self._accumulate = cfg.batch_size // cfg.minibatches // cfg.micro_batch  # micro-batches per step
        self._micro_steps = dict.fromkeys(self._optimizers, 0)

    # -- training --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, critic: bool = False) -> None:
        """Accumulate the gradient of the loss (the whole batch's share: one rank)."""
        loss.backward()

    def step(self, *, critic: bool = False) -> float | None:
        """AdamW step on the last of a step's micro-batches (None before): the gradient norm,
        clipped to learner.grad_clip; a non-finite one drops the gradients, changing nothing."""
        name = "critic" if critic else "policy"
        self._micro_steps[name] += 1
        if self._micro_steps[name] % self._accumulate:
            return None
        model, optimizer = (self.critic if critic else self.model), self._optimizers[name]
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.grad_clip or math.inf))
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad()
        return norm

    def set_lr(self, lr: float) -> None:
        for group in self._optimizers["policy"].param_groups:
            group["lr"] = lr

    # -- weights and checkpoints -----------------------------------------------------------
    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, p.detach()) for name, p in self.model.named_parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.to("cpu", copy=True) for name, t in self.named_full_weights()}

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir, state_dict=self.full_state_dict())

    def save_checkpoint(self, ckpt_dir: str | os.PathLike, tag: str, client_state: dict) -> None:
        """Models, optimizers and client_state in ckpt_dir/<tag>/state.pt; then `latest` names it
        (each file written whole, then renamed into place)."""
        path = Path(ckpt_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        state = {"client_state": client_state, "policy": self.model.state_dict(),
                 **{f"optimizer_{k}": opt.state_dict() for k, opt in self._optimizers.items()}}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        torch.save(state, path / (_STATE + ".tmp"))
        os.replace(path / (_STATE + ".tmp"), path / _STATE)
        mark_latest(ckpt_dir, tag)

    def load_checkpoint(self, ckpt_dir: str | os.PathLike) -> dict | None:
        latest = Path(ckpt_dir) / "latest"
        if not latest.is_file():
            return None
        path = Path(ckpt_dir) / latest.read_text().strip() / _STATE
        if not path.is_file():
            raise FileNotFoundError(f"{latest} names a checkpoint that is not there ({path}): restore it, "
                                    f"or delete {latest} to start afresh")
        state = torch.load(path, map_location=self.device)
        self.model.load_state_dict(state["policy"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        for k, opt in self._optimizers.items():
            opt.load_state_dict(state[f"optimizer_{k}"])
        return state["client_state"]
