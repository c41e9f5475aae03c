"""Generation engines behind async_rlhf.protocols.GenerationEngine, picked by generator.engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from async_rlhf.config import GeneratorConfig
from async_rlhf.devices import bf16_native
from async_rlhf.protocols import GenerationEngine
from async_rlhf.types import Prompt, Sample


def vllm_settings(cfg: GeneratorConfig, device: str, model_dtype: str = "float32") -> dict:
    """generator.dtype, gpu_memory_utilization and enforce_eager with `auto` resolved for
    `device` ("cpu" or "cuda[:i]"), as VLLMEngine takes them; see their config comments."""
    gpu = device.startswith("cuda")
    # bf16 where the device computes it natively, as the learner's autocast (mixed_precision)
    auto = {"dtype": "bfloat16" if gpu or bf16_native(device) else model_dtype,
            "gpu_memory_utilization": 0.5 if gpu else 0.3, "enforce_eager": not gpu}
    return {key: default if getattr(cfg, key) == "auto" else getattr(cfg, key) for key, default in auto.items()}


def weights_dtype(cfg: GeneratorConfig, device: str, model_dtype: str = "float32") -> str | None:
    """The dtype `cfg`'s engine holds its weights in on `device`, to which the learner casts each
    update before it leaves the learner's device (bf16 engines: half the bytes of fp32); None
    for the transformers engine, which takes updates as they come (its model is fp32)."""
    return vllm_settings(cfg, device, model_dtype)["dtype"] if cfg.engine == "vllm" else None


def make_engine(
    cfg: GeneratorConfig, model_path: str | Path, *, seed: int = 0, device: str | None = None,
    model_dtype: str = "float32",
) -> GenerationEngine:
    """The engine `cfg.engine` names, set up with cfg's sampling settings and threads; a vLLM
    engine also with vllm_settings (`model_dtype`: the training dtype, model.dtype)."""
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
        import torch

        from actors.engines.vllm_engine import VLLMEngine

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return VLLMEngine(model_path, tensor_parallel=cfg.tensor_parallel,
                          in_process=False if cfg.engine_core_process else None,
                          **vllm_settings(cfg, device, model_dtype), **{**common, "device": device})
    if cfg.engine == "hf":
        from actors.engines.hf_engine import HFEngine

        return HFEngine(model_path, **common)
    raise ValueError(f"generator.engine must be 'vllm' or 'hf', got {cfg.engine!r}")


def generate_all(engine, prompts: Sequence[Prompt], n: int, *, greedy: bool = False) -> list[list[Sample]]:
    """n samples (or episodes) of each prompt through `engine`'s submit and step, all at once:
    one list per prompt, in order (nothing else may be in flight)."""
    for i, prompt in enumerate(prompts):
        engine.submit(str(i), prompt, n, greedy=greedy)
    done: dict[str, list[Sample]] = {}
    while len(done) < len(prompts):
        done.update(engine.step())
    return [done[str(i)] for i in range(len(prompts))]
