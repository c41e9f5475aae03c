"""Generation engines behind async_rlhf.protocols.GenerationEngine, picked by generator.engine."""

from __future__ import annotations

from pathlib import Path

from async_rlhf.config import GeneratorConfig
from async_rlhf.protocols import GenerationEngine


def make_engine(
    cfg: GeneratorConfig, model_path: str | Path, *, seed: int = 0, device: str | None = None
) -> GenerationEngine:
    """The engine `cfg.engine` names, set up with cfg's sampling settings and threads."""
    common = dict(
        max_new_tokens=cfg.max_new_tokens,
        stop=cfg.stop,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        threads=cfg.threads,
        seed=seed,
        device=device,
    )
    if cfg.engine == "vllm":
        from actors.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, tensor_parallel=cfg.tensor_parallel, **common)
    if cfg.engine == "hf":
        from actors.engines.hf_engine import HFEngine

        return HFEngine(model_path, **common)
    raise ValueError(f"generator.engine must be 'vllm' or 'hf', got {cfg.engine!r}")
