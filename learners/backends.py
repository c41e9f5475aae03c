"""The learner's TrainBackend by learner.backend: DeepSpeed (any ZeRO stage and rank count) or
plain torch (one process)."""

from __future__ import annotations

from async_rlhf.config import LearnerConfig
from async_rlhf.hub import resolve_model
from async_rlhf.protocols import TrainBackend


def make_backend(cfg: LearnerConfig, model_path: str, *, dtype: str, temperature: float,
                 seed: int) -> TrainBackend:
    """`model_path`: a model directory or a Hub id, resolved through this node's cache."""
    model_path = resolve_model(model_path)
    if cfg.backend == "torch":
        from learners.torch_backend import TorchBackend

        return TorchBackend(cfg, model_path, dtype=dtype, temperature=temperature, seed=seed)
    from learners.deepspeed_backend import DeepSpeedBackend

    return DeepSpeedBackend(cfg, model_path, dtype=dtype, temperature=temperature, seed=seed)
