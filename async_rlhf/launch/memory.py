"""How much memory a job's parts take at their peak, from the model's shape and the settings,
before anything starts (no torch: the launcher reads the model's config.json).

Each part's peak, in bytes (P parameters, R learner ranks, ZeRO stage s):
- a learner rank: its process; the policy's weights, gradients and AdamW states (4 + 4 + 8 bytes
  a parameter in float32; ZeRO 1 shards the optimizer over R ranks and keeps a float32 master
  partition, 2 the gradients too, 3 the weights too); under bf16 autocast, the weights' bf16
  copies autocast caches through a forward (2 bytes); the frozen reference (kl_coef > 0, dpo) in
  its dtype; the critic (gae) trained like the policy; the activations a micro-batch keeps for
  its backward (every layer's, or one layer's plus each layer's input with gradient
  checkpointing); the LM head's chunk of logits (learners/models.py); DeepSpeed's communication
  buckets.
- a generator: its process (vLLM, its reward workers); the engine's weights in its dtype (on CPU
  with oneDNN's packed copies, and the new ones a weight load builds); the KV
  cache (VLLM_CPU_KVCACHE_SPACE on CPU); an update being staged (a whole copy, plus one per
  version generator.weight_lag holds back); the sampler's logits for the running sequences.
- an evaluator (eval.every > 0): an engine like a generator's.
- the rest: the launcher, Ray's own processes, Redis.

The process sizes are measured (`async-rlhf bench-memory`, which prints this estimate beside the
measured peaks): see BASE_GB.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from async_rlhf.config import Config

GB = 1 << 30
# Each kind of process without the model (imports, allocator, Ray's worker), and Ray's, the
# launcher's and Redis's together: proportional set sizes measured on the tiny and small presets
# by `async-rlhf bench-memory` (2-core x86 VM, avx512_bf16, 2026-12-05)
BASE_GB = {"learner": 0.35, "generator": 0.5, "reward_worker": 0.12, "rest": 0.35}
# Float32 values an activation keeps per token, per layer, beyond hidden_size x these
# (norm inputs, q/k/v, attention output, residuals; the MLP's gate, up and activation are
# intermediate_size x MLP_ACTIVATIONS)
HIDDEN_ACTIVATIONS, MLP_ACTIVATIONS = 8, 4
LOGIT_CHUNK_ELEMENTS = 1 << 23  # learners/models.py's; ~6 float32 copies of a chunk are live
DEEPSPEED_BUCKET_BYTES = 4 * 50_000_000  # learners/deepspeed_backend.py _zero_config, ZeRO >= 1
PROMPT_TOKENS = 256  # a prompt's tokens where neither the data nor generator.max_prompt_tokens bound them
CHAT_TEMPLATE_TOKENS = 64  # what a chat template adds around a prompt's text, at most


@dataclass(frozen=True)
class ModelShape:
    params: int
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    max_positions: int

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From a transformers config.json (its text_config for multimodal ones). The parameter
        count is the sum of the shapes every supported family has (embeddings, attention with GQA,
        a gated or plain MLP, an untied output layer where untied); norms and biases, under 0.1%
        of a model, are left out."""
        c = config.get("text_config") or config
        get = lambda *keys, default=None: next((c[k] for k in keys if c.get(k) is not None), default)  # noqa: E731
        hidden, vocab = get("hidden_size", "n_embd"), get("vocab_size")
        layers, heads = get("num_hidden_layers", "n_layer"), get("num_attention_heads", "n_head")
        head_dim = get("head_dim", default=hidden // heads)
        kv = get("num_key_value_heads", default=heads) * head_dim
        gated = c.get("model_type") != "gpt2"
        intermediate = get("intermediate_size", "n_inner") or 4 * hidden
        attention = hidden * heads * head_dim * 2 + hidden * kv * 2
        mlp = hidden * intermediate * (3 if gated else 2)
        tied = c.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
        positions = get("max_position_embeddings", "n_positions", default=2048)
        embeddings = vocab * hidden * (1 if tied else 2) + (0 if gated else positions * hidden)
        return cls(embeddings + layers * (attention + mlp), vocab, hidden, layers, intermediate, heads, positions)

    @classmethod
    def of(cls, cfg: Config) -> ModelShape:
        """The shape of the model cfg names: its config.json where it is there, else the preset
        it will be built from (the character tokenizer's vocabulary, or the BPE one's)."""
        path = Path(cfg.model.path) / "config.json"
        if path.is_file():
            return cls.from_config(json.loads(path.read_text()))
        if cfg.model.preset is None:
            from async_rlhf.hub import resolve_model

            return cls.from_config(json.loads((Path(resolve_model(cfg.model.path)) / "config.json").read_text()))
        from actors.model_init import BPE_VOCAB_SIZE
        from async_rlhf.synthetic import CHAR_VOCAB_SIZE, PRESETS

        p = PRESETS[cfg.model.preset]
        vocab = CHAR_VOCAB_SIZE if cfg.model.tokenizer == "char" else BPE_VOCAB_SIZE
        return cls.from_config({"hidden_size": p.hidden_size, "num_hidden_layers": p.num_layers,
                                "num_attention_heads": p.num_heads, "intermediate_size": p.intermediate_size,
                                "vocab_size": vocab, "max_position_embeddings": p.max_positions,
                                "tie_word_embeddings": False})


@dataclass(frozen=True)
class Sizes:
    """What the estimate reads besides the config: the model's shape, whether the device computes
    bf16 natively (learner.mixed_precision and generator.dtype auto then choose it), and the
    longest prompt's characters (preflight; None: PROMPT_TOKENS), a bound on its tokens."""
    shape: ModelShape
    native_bf16: bool = False
    prompt_chars: int | None = None

    def prompt_tokens(self, cfg: Config) -> int:
        bound = PROMPT_TOKENS if self.prompt_chars is None else self.prompt_chars + CHAT_TEMPLATE_TOKENS
        return min(bound, cfg.generator.max_prompt_tokens or bound)


@dataclass(frozen=True)
class MemoryEstimate:
    learner_rank: float  # bytes, each rank at its peak
    ranks: int
    generator: float  # bytes, each generator
    generators: int
    evaluator: float  # bytes (0: none)
    rest: float  # Ray, the launcher, Redis

    @property
    def total(self) -> float:
        return self.learner_rank * self.ranks + self.generator * self.generators + self.evaluator + self.rest

    def line(self) -> str:
        ev = f" + evaluator {self.evaluator / GB:.1f}" if self.evaluator else ""
        return (f"{self.total / GB:.1f} GiB = learner {self.ranks} x {self.learner_rank / GB:.1f} + generators "
                f"{self.generators} x {self.generator / GB:.1f}{ev} + Ray, Redis and the launcher {self.rest / GB:.1f}")


def _learner_rank(cfg: Config, sizes: Sizes) -> float:
    lc, m, r = cfg.learner, sizes.shape, cfg.learner.ranks
    p = m.params
    bf16_compute = lc.mixed_precision == "bf16" or (lc.mixed_precision == "auto" and sizes.native_bf16)
    w = 2 if cfg.model.dtype == "bfloat16" else 4
    shard = lambda stage: r if lc.zero_stage >= stage else 1  # noqa: E731
    # float32 weights: AdamW's two states; ZeRO >= 1 (or bf16 weights) adds a float32 master copy
    master = 4 if (lc.zero_stage or w == 2) else 0
    trained = p * (w / shard(3) + 4 / shard(2) + (8 + master) / shard(1))
    # the optimizer step's temporaries (a gradient-sized buffer); ZeRO >= 1's flat gradient
    # buffers and flattening copies, and offload's host copies: measured, bench-memory --learner
    trained += p * (4 + (8 if lc.zero_stage else 0) + (4 if lc.offload_optimizer else 0))
    if lc.zero_stage:
        trained += DEEPSPEED_BUCKET_BYTES
    if bf16_compute and w == 4:
        trained += 2 * p  # autocast's bf16 copies of the weights, cached through a forward
    reference = 0.0
    if lc.kl_coef > 0 or lc.algorithm == "dpo":
        ref_bf16 = lc.reference_dtype == "bfloat16" or (lc.reference_dtype == "auto" and bf16_compute)
        reference = p * (2 if ref_bf16 else w)
    critic = trained if lc.advantage == "gae" else 0.0
    # rank 0's weight update, packed in the engines' dtype (each weight copied straight into it)
    publish = p * _engine_bytes(cfg, sizes.native_bf16)
    tokens = lc.micro_batch * min(m.max_positions, cfg.generator.max_new_tokens + sizes.prompt_tokens(cfg))
    per_layer = tokens * 4 * (HIDDEN_ACTIVATIONS * m.hidden + MLP_ACTIVATIONS * m.intermediate)
    kept = tokens * 4 * m.hidden * m.layers + per_layer if lc.gradient_checkpointing else per_layer * m.layers
    activations = kept * (2 if lc.advantage == "gae" else 1)
    logits = 4 * 6 * min(LOGIT_CHUNK_ELEMENTS, tokens * m.vocab)
    return BASE_GB["learner"] * GB + trained + reference + critic + publish + activations + logits


def _engine_bytes(cfg: Config, native_bf16: bool) -> int:
    """Bytes a parameter of an engine's weights takes (generator.dtype)."""
    g = cfg.generator
    dtype = g.dtype if g.dtype != "auto" else ("bfloat16" if native_bf16 else cfg.model.dtype)
    return 4 if dtype == "float32" else 2


def _engine(cfg: Config, m: ModelShape, native_bf16: bool, gpu: bool) -> float:
    g = cfg.generator
    w = _engine_bytes(cfg, native_bf16)
    # the KV cache vLLM allocates (VLLM_CPU_KVCACHE_SPACE on CPU, which it fills at start); on
    # GPU its share of the device, not of the host
    kv = 0.0 if gpu else float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * GB
    staged = m.params * w * (1 + g.weight_lag)  # updates arrive in the engine's dtype
    logits = g.max_inflight * m.vocab * 4 * 2
    workers = g.reward_concurrency * BASE_GB["reward_worker"] * GB
    # on CPU vLLM's linear layers keep oneDNN's packed copy of their weights beside them, and a
    # weight load builds the new packed copy before the old one goes (vllm/model_executor/
    # layers/utils.py dispatch_cpu_unquantized_gemm): three copies at a load's peak
    weights = m.params * w * (1 if gpu else 3)
    return BASE_GB["generator"] * GB + weights + kv + staged + logits + workers


def estimate(cfg: Config, sizes: Sizes, gpu: bool = False) -> MemoryEstimate:
    """Each part's peak for `cfg` (see the module doc)."""
    engine = _engine(cfg, sizes.shape, sizes.native_bf16, gpu)
    return MemoryEstimate(_learner_rank(cfg, sizes), cfg.learner.ranks, engine, cfg.generator.count,
                          engine if cfg.eval.every else 0.0, BASE_GB["rest"] * GB)


def host_memory() -> float:
    """Bytes this machine can give a job now: MemAvailable (free memory plus what the kernel can
    reclaim), what Ray's memory monitor measures against."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def out_of_memory(error: str, cfg: Config, sizes: Sizes | None) -> str | None:
    """What ended a job that Ray's memory monitor broke into (None for any other error): how full
    the node was, what was killed, the largest processes beside their part's estimate, and the
    settings placement estimates would have fit, with the estimate scaled by what was measured.
    (Ray picks which worker to kill by its policy: not always the largest.)"""
    if "running low on memory" not in error:
        return None
    import re

    node = re.search(r"was ([\d.]+)GB used / ([\d.]+)GB limit", error)
    killed = re.search(r"Selected to kill:.*?task name=([^,]+),.*?actual memory used=([\d.]+)GB", error, re.DOTALL)
    largest = re.findall(r"^\d+\t([\d.]+)\t(\S+)", error, re.MULTILINE)[:3]
    est = estimate(cfg, sizes) if sizes else None
    parts = {"Learner": ("learner rank", est and est.learner_rank), "Generator": ("generator", est and est.generator)}
    described, scale = [], {}  # scale: measured over estimated, by part
    for used, command in largest:
        name, guess = next((v for k, v in parts.items() if k in command), (command, None))
        described.append(f"{name} {used} GB" + (f" (estimated {guess / GB:.1f} GiB)" if guess else ""))
        if guess:
            scale.setdefault(name, float(used) * 1e9 / guess)
    text = "out of memory: Ray's memory monitor killed " + (
        f"{killed.group(1)} ({killed.group(2)} GB)" if killed else "a worker")
    if node:
        text += f" with the node at {node.group(1)} of {node.group(2)} GB"
    if described:
        text += "; the largest processes: " + ", ".join(described)
    if est and node:
        from async_rlhf.launch.placement import MEMORY_SHARE, _candidates, _changes

        # each part's estimate scaled by what its process measured (the node's fill over the
        # whole estimate where neither was among the largest)
        whole = float(node.group(1)) * 1e9 / est.total
        learner, generator = scale.get("learner rank", whole), scale.get("generator", whole)

        def scaled(e: MemoryEstimate) -> float:
            return e.total + e.learner_rank * e.ranks * (learner - 1) + \
                (e.generator * e.generators + e.evaluator) * (generator - 1)

        room = MEMORY_SHARE * float(node.group(2)) * 1e9
        fits = [c for c in _candidates(cfg) if _changes(cfg, c) and scaled(estimate(c, sizes)) <= room]
        text += (f". Set {_changes(cfg, fits[0])} (estimated to fit, after scaling the estimate by what was "
                 f"measured here: learner {learner:.2f}x, generator {generator:.2f}x)"
                 if fits else
                 ". Free memory on this node, or lower generator.count, learner.micro_batch or the model's size")
    return text
