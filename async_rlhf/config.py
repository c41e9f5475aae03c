"""One typed config: YAML file + `key=value` overrides, checked once at start.

Every section is a frozen dataclass. Unknown keys are errors; every value is checked against its
annotation (Literal choices included) and its range, and errors name the key, the value and what
is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    pass


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against a type hint; return it (ints accepted where floats are expected)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        _check(value in choices, key, value, "one of " + ", ".join(map(repr, choices)))
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inners = [a for a in args if a is not type(None)]
        for inner in inners[:-1]:  # the first type the value fits
            try:
                return _check_type(key, value, inner)
            except ConfigError:
                pass
        return _check_type(key, value, inners[-1])
    if origin is tuple:
        _check(isinstance(value, (list, tuple)), key, value, "a list")
        (inner, _) = typing.get_args(hint)
        return tuple(_check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value))
    if origin is dict:
        _check(isinstance(value, dict), key, value, "a mapping")
        key_hint, value_hint = typing.get_args(hint)
        return {_check_type(f"{key} key", k, key_hint): _check_type(f"{key}[{k!r}]", v, value_hint)
                for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        _check(isinstance(value, hint), key, value, f"a {hint.__name__} mapping")
        return value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _check(ok, key, value, "a number")
        return float(value)
    if hint is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        return value
    _check(isinstance(value, hint), key, value, f"of type {hint.__name__}")
    return value


class _Section:
    """Type-checks every field after construction; subclasses add range checks in `_validate`."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _check_type(f"{self._prefix}{f.name}", getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self._validate()

    _prefix = ""

    def _validate(self) -> None:
        pass

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            _check(value > 0, self._prefix + name, value, "> 0")


@dataclass(frozen=True)
class ModelConfig(_Section):
    _prefix = "model."
    # a Hugging Face model directory (config.json, weights, tokenizer), or a Hub id such as
    # Qwen/Qwen2.5-0.5B-Instruct that every process resolves through its own Hugging Face cache
    # (HF_HOME), downloading it unless HF_HUB_OFFLINE is set; with a preset, a directory to build
    path: str = "runs/models/tiny"
    # what init-model builds at `path` when it holds no model; unset, a missing `path` is an error
    preset: Literal["tiny", "small"] | None = None
    tokenizer: Literal["char", "bpe"] = "char"  # ...and with which tokenizer (actors/model_init.py)
    dtype: Literal["float32", "bfloat16"] = "float32"  # the weights' dtype in the learner and the generators


@dataclass(frozen=True)
class DataConfig(_Section):
    _prefix = "data."
    # where prompts come from: a built-in task, a JSONL file or a saved HF dataset; or
    # preferences: no generation, a JSONL file of {prompt, chosen, rejected} pairs trained by
    # learner.algorithm=dpo (actors/preferences.py)
    source: Literal["task", "jsonl", "hf_dataset", "preferences"] = "task"
    task: str = "count"  # built-in task name when source == "task"
    path: str = ""  # JSONL file or dataset directory for the other sources
    prompt_key: str = "prompt"  # holds a string, or a list of {"role", "content"} messages
    answer_key: str = "answer"  # the record key passed to rewards as the answer (optional in records)
    system_prompt: str = ""  # a system message put first in every conversation
    # auto: conversations (message lists) are rendered with the tokenizer's chat template, plain
    # strings go in as they are; on: every prompt is rendered (a string as one user message);
    # off: none is; or the path of a Jinja template file to render every prompt with.
    chat_template: str = "auto"
    # extra variables for the chat template (apply_chat_template's keyword arguments), e.g.
    # {enable_thinking: false} for Qwen3's template
    chat_template_kwargs: dict[str, str | bool | int | float] = field(default_factory=dict)

    def _validate(self) -> None:
        if self.source != "task":
            _check(bool(self.path), "data.path", self.path, f"set when data.source={self.source}")
        _check(self.chat_template in ("auto", "on", "off") or Path(self.chat_template).is_file(),
               "data.chat_template", self.chat_template, "auto, on, off or an existing Jinja file")
        _check(not (self.system_prompt and self.chat_template == "off"), "data.system_prompt",
               self.system_prompt, "empty with data.chat_template=off (it is a chat message)")
        _check(not (self.chat_template_kwargs and self.chat_template == "off"), "data.chat_template_kwargs",
               self.chat_template_kwargs, "empty with data.chat_template=off (no template renders prompts)")


@dataclass(frozen=True)
class RewardSpec(_Section):
    _prefix = "reward."
    # a Python function, an HF reward-model directory, or an HTTP endpoint
    kind: Literal["function", "model", "http"] = "function"
    target: str = ""  # module:function, a model directory, or a URL
    weight: float = 1.0  # this reward's weight in the sum that is the trajectory's reward
    timeout_s: float = 10.0  # the most seconds one scoring call (one HTTP attempt) may take
    retries: int = 2  # HTTP retries after a connection error, a 5xx answer or a timeout

    def _validate(self) -> None:
        _check(bool(self.target), "reward.target", self.target, "a module:function, path or URL")
        self._positive("timeout_s")
        _check(self.retries >= 0, "reward.retries", self.retries, ">= 0")


@dataclass(frozen=True)
class GeneratorConfig(_Section):
    _prefix = "generator."
    # vllm (continuous batching, in-flight weight updates) or hf (transformers generate)
    engine: Literal["vllm", "hf"] = "vllm"
    count: int = 1  # generator actors at start (`add-generators` adds more while the job runs)
    group_size: int = 8  # samples per prompt (GRPO's n; TRL's num_generations default)
    # Sequences (group_size per group) a generator holds in its engine at once. vLLM on one
    # CPU thread makes ~4x the tokens/s with 64 in flight that it makes with 8.
    max_inflight: int = 64
    # stream: a group is admitted as soon as a slot frees and streams out when its last sample
    # is scored (continuous batching). lockstep: admit a whole batch of max_inflight sequences
    # into an empty engine and wait for its longest sequence (the old generator, for comparison).
    schedule: Literal["stream", "lockstep"] = "stream"
    # inflight: new weights load between two engine steps; sequences in flight go on with them
    # (their tokens record which version sampled them). between_groups: a new version waits
    # until the engine is empty (no admission meanwhile), so one version samples all of a group.
    weight_updates: Literal["inflight", "between_groups"] = "inflight"
    max_new_tokens: int = 256  # the most tokens a response may have (TRL's default)
    # The most tokens a prompt (as rendered, template included) may have; 0: no limit besides the
    # model's context minus max_new_tokens. Longer prompts are skipped, never cut (a cut prompt
    # would lose its chat markup or question), and counted in a warning at the generators' start
    # (actors/prompts.py); training and eval prompts alike.
    max_prompt_tokens: int = 0
    # Stop sequences: a response also ends (besides at EOS or an end-of-turn token) at the token
    # that completes one of these in its text. That token is kept, trained on and has its
    # log-prob; the text rewards get ends before the stop string (vLLM's stop).
    stop: tuple[str, ...] = ()
    temperature: float = 1.0  # sampling temperature; the learner's log-probs use the same one
    top_p: float = 1.0  # must be 1.0 (nucleus sampling would bias the importance weights)
    threads: int = 1  # torch/vLLM CPU threads per generator
    # Ray custom resources each of the job's own generators asks for besides its CPUs/GPUs, e.g.
    # {node_b: 1} to run them on a node started with `ray start --resources='{"node_b": 8}'`;
    # a replaced generator asks for the same (`add-generators --resources` sets its own).
    resources: dict[str, float] = field(default_factory=dict)
    # CPU scheduling priority of the generator processes once their engine is up: a nice
    # increment, 0-19, over the learner's 15 (Ray's workers'; 19 at most). Where they share cores
    # with the learner, a positive value gives the learner's threads the larger share and the
    # generators the rest (placement: auto sets 19 on CPU; see its module doc).
    nice: int = 0
    tensor_parallel: int = 1  # GPU only
    # vLLM's weights and compute dtype. auto: bfloat16 on GPU and on a CPU that computes bf16
    # natively (avx512_bf16, AMX), as the learner's autocast; else model.dtype. Its log-probs then
    # differ from the learner's by bf16 round-off, which the behaviour weight corrects; float32
    # ones match a float32 learner's to 3e-4.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # vLLM's share of the device's memory (weights, activations, KV cache). auto: 0.3 on CPU
    # (with VLLM_CPU_KVCACHE_SPACE=1; vLLM's own 0.9 fails its start-up memory check), 0.5 on GPU.
    gpu_memory_utilization: Literal["auto"] | float = "auto"
    # vLLM without CUDA graphs or torch.compile. auto: on for CPU (compiling would take minutes),
    # off on GPU (graphs speed up decoding).
    enforce_eager: Literal["auto"] | bool = "auto"
    # vLLM's engine core in a process of its own on CPU too, as it always is on GPU (weights and
    # requests then cross that process boundary); off: in the generator's process on CPU, which
    # starts in ~3 s against ~30 s
    engine_core_process: bool = False
    max_restarts: int = 10  # a generator that dies is replaced, after 1, 2, 4 ... 30 s, this often
    # Groups a generator scores at once, each in a reward worker process of its own (a call
    # past its reward's deadline has its process killed and replaced), so one slow or hung
    # reward call holds back only its own group. Each worker holds a copy of the rewards
    # (a reward model's memory too).
    reward_concurrency: int = 2
    # A generator whose engine takes no step for this many seconds while it holds sequences
    # (a hung engine loop: its process still answers) is killed and replaced like a dead one.
    # One step takes well under a second here: the default leaves room for any slow machine.
    stall_s: float = 300.0
    # Load the weights of version V - weight_lag when version V arrives (0: the newest), so that
    # every sample is exactly min(V, weight_lag) versions old when trained: the staleness study
    # (`async-rlhf study staleness`) uses it to realise k whatever the stages' speeds.
    weight_lag: int = 0
    # Dynamic sampling (DAPO): a group whose rewards are all equal (GRPO learns nothing from it)
    # is dropped before the stream and counted (dropped_uniform); the gate frees its slots, so
    # the generator keeps producing and learner batches stay full of groups that teach.
    drop_uniform_groups: bool = False
    # Dynamic sampling's bound: at most this many groups drawn (generated and scored) per group
    # put on the stream, over each generator's last 8x this many groups. Past it, uniform groups
    # go to the stream (advantage 0, counted as admitted_uniform, a warning the first time), so
    # a solved task's steps keep the generation rate instead of stalling; dropping resumes once
    # the rate falls back. 1: drop nothing. verl raises an error at its cap instead (DAPO's
    # recipe: 10 generation batches of 3x the train batch).
    max_draws_per_group: int = 4

    def _validate(self) -> None:
        _check(self.max_restarts >= 0, "generator.max_restarts", self.max_restarts, ">= 0")
        _check(self.weight_lag >= 0, "generator.weight_lag", self.weight_lag, ">= 0")
        _check(self.max_prompt_tokens >= 0, "generator.max_prompt_tokens", self.max_prompt_tokens,
               ">= 0 (0: no limit besides the model's context)")
        _check(0 <= self.nice <= 19, "generator.nice", self.nice, "from 0 (normal priority) to 19 (lowest)")
        self._positive("count", "group_size", "max_new_tokens", "threads", "reward_concurrency")
        self._positive("temperature", "tensor_parallel", "stall_s")
        _check(self.max_draws_per_group >= 1, "generator.max_draws_per_group", self.max_draws_per_group,
               ">= 1 (groups drawn per group put; 1: dynamic sampling drops nothing)")
        _check(self.engine == "vllm" or not self.engine_core_process, "generator.engine_core_process",
               self.engine_core_process, f"false with generator.engine={self.engine} (vLLM's option)")
        if self.gpu_memory_utilization != "auto":
            _check(0 < self.gpu_memory_utilization <= 1, "generator.gpu_memory_utilization",
                   self.gpu_memory_utilization, "auto or a fraction in (0, 1]")
        for name, amount in self.resources.items():
            _check(name not in ("CPU", "GPU", "memory"), "generator.resources", self.resources,
                   "custom resources only: CPUs come from generator.threads, GPUs from "
                   "generator.tensor_parallel")
            _check(amount > 0, f"generator.resources[{name!r}]", amount, "> 0")
        _check(all(self.stop), "generator.stop", list(self.stop),
               "a list of non-empty strings (an empty one would stop every response at once)")
        _check(self.max_inflight >= self.group_size, "generator.max_inflight", self.max_inflight,
               f">= generator.group_size ({self.group_size}): the engine holds whole groups")
        # The learner recomputes log-probs over the whole vocabulary; nucleus sampling would
        # make every behaviour weight pi_prox / pi_behaviour biased below 1.
        _check(self.top_p == 1.0, "generator.top_p", self.top_p,
               "1.0 for training (nucleus sampling biases the importance weights)")


def redact_url(url: str) -> str:
    """`url` fit to print: any user and password become *** (redis://***@host:port/0)."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    return f"{scheme}{sep}***@{rest[at + 1:]}" if at >= 0 else url


@dataclass(frozen=True)
class QueueConfig(_Section):
    _prefix = "queue."
    redis_url: str | None = None  # None: start an embedded redis-server on a free loopback port
    stream: str = "experience"  # the Redis stream's key
    group: str = "learners"  # the stream's consumer group
    max_backlog: int = 4096  # producers wait while more entries than this are unconsumed
    durable: bool = False  # embedded Redis with AOF everysec
    claim_idle_ms: int = 30_000  # pending entries idle this long are reclaimed from dead consumers
    max_deliveries: int = 3  # an entry delivered more often without an ack is dead-lettered

    def _validate(self) -> None:
        self._positive("max_backlog", "claim_idle_ms", "max_deliveries")


@dataclass(frozen=True)
class LearnerConfig(_Section):
    _prefix = "learner."
    steps: int = 50  # learner steps (policy versions) the job trains
    batch_size: int = 32  # trajectories per optimizer step
    micro_batch: int = 8  # trajectories per forward/backward pass on one rank
    # a micro-batch's rows packed end to end (no forward on padding) into rows of at most 128
    # tokens (unbounded with flash-attention), where that computes 10% fewer positions than
    # padding them to the longest; false: always padded. A model whose attention mixes packed
    # rows (checked at the first forward) trains padded, with a warning
    packing: bool = True
    # deepspeed: ZeRO 0-3, any number of ranks, bf16; torch: one process, fp32, torch.optim.AdamW
    # (no DeepSpeed engine: fewer moving parts where one CPU or GPU trains)
    backend: Literal["deepspeed", "torch"] = "deepspeed"
    ranks: int = 1  # learner processes (data parallel, DeepSpeed)
    threads: int = 1  # torch CPU threads per rank; its Ray actor reserves as many CPUs
    zero_stage: Literal[0, 1, 2, 3] = 0  # DeepSpeed ZeRO stage
    # the policy's learning rate (AdamW): TRL's GRPO default, for a pretrained model (a random-init
    # one, as the demo's, learns at ~1e-3)
    lr: float = 1e-6
    # learner steps (policy versions) over which the policy's learning rate rises linearly, from
    # lr / lr_warmup_steps at the first to lr at the last (every minibatch of a step has its lr)
    lr_warmup_steps: int = 0
    # the policy's learning rate after the warmup: lr throughout (constant), or decaying from lr
    # to 0 at learner.steps linearly or along a half cosine (learners/schedule.py)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # the gradients' global norm is clipped to this (0: no clipping)
    clip_eps: float = 0.2  # PPO's clip range for the ratio pi_theta / pi_prox
    # the ratio's upper clip bound is 1 + clip_eps_high (DAPO's clip-higher, e.g. 0.28): the ratio
    # is clipped to [1 - clip_eps, 1 + clip_eps_high]; unset: 1 + clip_eps
    clip_eps_high: float | None = None
    # behaviour correction pi_prox / pi_behaviour: none, truncated at is_cap (TIS) or masked above it
    correction: Literal["none", "truncate", "mask"] = "truncate"
    # the correction weight per token or per sequence
    correction_level: Literal["token", "sequence"] = "token"
    is_cap: float = 2.0  # where the behaviour correction weight is truncated or masked
    ratio_to: Literal["prox", "behavior"] = "prox"  # "behavior": plain PPO, for ablation
    # how per-token losses are averaged over a batch
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    # advantage estimator (gae trains a critic)
    advantage: Literal["grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    gamma: float = 1.0  # discount (gae, reinforce_pp)
    lam: float = 1.0  # GAE's lambda
    kl_coef: float = 0.0  # weight of the KL penalty to the initial policy (0: no reference model)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # KL estimator (Schulman's k1, k2, k3)
    # the KL penalty as a loss term, or as a per-token reward (reinforce_pp, gae)
    kl_mode: Literal["reward", "loss"] = "loss"
    entropy_coef: float = 0.0  # weight of the entropy bonus
    value_clip: float = 0.2  # the critic's value clip range (gae)
    max_reuse: int = 1  # times a trajectory may be trained on while within the staleness bound
    checkpoint_every: int = 10  # steps (a crashed learner loses at most this many); 0: only at the end
    keep_checkpoints: int = 2  # the newest this many checkpoints stay on disk; older ones are deleted
    minibatches: int = 1  # optimizer steps per batch, all against the same pi_prox (AReaL's n_mbs)
    optimizer: Literal["adamw_torch", "adamw_deepspeed"] = "adamw_torch"  # deepspeed: C++ build
    critic_lr: float = 1e-5  # GAE only
    critic_init: str = ""  # reward-model directory to start the critic from; "": the policy's
    flash_attention: bool = True  # flash-attention 2 on GPU when installed; CPU always uses sdpa
    # Memory (README "Real sizes"): each off unless set, or chosen by placement: auto where its
    # estimate (launch/placement.py) needs it to fit. Recompute each layer's activations in the
    # backward instead of keeping them (~30% more compute)
    gradient_checkpointing: bool = False
    # AdamW's states and step on the host (DeepSpeed's offload_optimizer, pinned memory on GPU):
    # 12 bytes a parameter off the device; ZeRO stage >= 1. Nothing to save on a CPU-only machine
    offload_optimizer: bool = False
    offload_params: bool = False  # ZeRO-3's parameter shards on the host between uses (offload_param)
    # the frozen reference's weights (kl_coef > 0, dpo): auto holds them in bfloat16 where forward
    # passes run in bf16 anyway (mixed_precision), halving it at the cost of rounding its norms'
    # weights; else float32
    reference_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # bf16: forward passes under bf16 autocast with float32 weights, gradients and optimizer
    # (mixed precision, the standard trainers' default); auto: bf16 where the device computes it
    # natively (a GPU with bf16, a CPU with avx512_bf16 or AMX), else fp32; fp32: float32 throughout
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    wait_s: float = 60.0  # a step fails if the stream delivers nothing usable for this long
    max_restarts: int = 3  # a dead learner rank restarts (all ranks, from the newest checkpoint)
    # a step that runs longer (its wait for data included) is taken for a hung rank, e.g. one stuck
    # in a collective with a rank that stopped: every rank restarts, as for a dead one
    step_timeout_s: float = 1800.0
    # The objective trained on each batch of groups: ppo (the policy-gradient losses that
    # clip_eps, correction, advantage... configure); dpo (each group's highest-reward response
    # chosen, its lowest rejected, against a frozen copy of the initial policy); rs (rejection
    # sampling, best-of-n: supervised fine-tuning on each group's best response)
    algorithm: Literal["ppo", "dpo", "rs"] = "ppo"
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"  # DPO's logistic loss, or IPO's squared one
    dpo_beta: float = 0.1  # DPO's beta: the strength of the implicit KL to the reference
    dpo_length_norm: bool = False  # dpo: mean per-token log-probs of a response instead of their sum
    rs_threshold: float = 0.0  # rs trains on a group's best response only if its reward is at least this
    # Before advantages (learners/shaping.py), in this order. Responses cut at their token limit
    # (generator.max_new_tokens; env.max_tokens or env.max_turns for episodes): none; mask (loss
    # mask 0, DAPO's overlong filtering); soft (DAPO's soft punishment: the reward falls linearly
    # by up to overlong_penalty over the last overlong_buffer tokens before the limit).
    overlong: Literal["none", "mask", "soft"] = "none"
    overlong_buffer: int = 0  # soft: tokens before the limit where the penalty starts (DAPO's L_cache)
    overlong_penalty: float = 1.0  # soft: the penalty at the limit
    reward_norm: bool = False  # rewards minus their running mean, over their running std (every batch so far)
    reward_clip: float = 0.0  # rewards (normalised, with reward_norm) clipped to [-c, c]; 0: no clipping

    def _validate(self) -> None:
        self._positive("steps", "batch_size", "micro_batch", "ranks", "threads", "lr", "clip_eps", "is_cap")
        self._positive("dpo_beta")
        if self.algorithm != "ppo":
            _check(self.advantage != "gae", "learner.advantage", self.advantage,
                   f"grpo, rloo or reinforce_pp with learner.algorithm={self.algorithm} "
                   "(gae trains a critic that dpo and rs never use)")
            shaped = {k: v for k, v in (("overlong", self.overlong), ("reward_norm", self.reward_norm),
                                        ("reward_clip", self.reward_clip)) if v not in ("none", False, 0)}
            _check(not shaped, "learner's reward shaping", shaped,
                   f"off with learner.algorithm={self.algorithm}: it picks pairs and best responses "
                   "by the rewards as scored (rs_threshold too); overlong and reward_norm/clip are ppo's")
            _check(self.kl_coef == 0, "learner.kl_coef", self.kl_coef,
                   f"0 with learner.algorithm={self.algorithm} (dpo has its KL strength in "
                   "learner.dpo_beta, rs no KL term)")
        self._positive("max_reuse", "minibatches", "critic_lr", "wait_s", "keep_checkpoints")
        _check(0 <= self.lr_warmup_steps <= self.steps, "learner.lr_warmup_steps", self.lr_warmup_steps,
               f"in 0..learner.steps ({self.steps}): a warmup cannot outlast the run")
        if self.clip_eps_high is not None:
            _check(self.clip_eps_high > 0, "learner.clip_eps_high", self.clip_eps_high,
                   "> 0 (or unset: the upper bound is 1 + learner.clip_eps)")
        _check(self.step_timeout_s > self.wait_s, "learner.step_timeout_s", self.step_timeout_s,
               f"above learner.wait_s={self.wait_s:g} (a step's wait for data counts towards it)")
        _check(self.max_restarts >= 0, "learner.max_restarts", self.max_restarts, ">= 0")
        _check(self.reward_clip >= 0, "learner.reward_clip", self.reward_clip, ">= 0 (0: no clipping)")
        _check(self.overlong_penalty >= 0, "learner.overlong_penalty", self.overlong_penalty, ">= 0")
        if self.offload_optimizer or self.offload_params:
            _check(self.backend == "deepspeed", "learner.backend", self.backend,
                   "deepspeed with learner.offload_optimizer or offload_params (DeepSpeed's ZeRO offload)")
        if self.offload_optimizer:
            _check(self.zero_stage >= 1, "learner.zero_stage", self.zero_stage,
                   ">= 1 with learner.offload_optimizer=true (ZeRO offloads the states it partitions)")
        if self.offload_params:
            _check(self.zero_stage == 3, "learner.zero_stage", self.zero_stage,
                   "3 with learner.offload_params=true (only ZeRO-3 partitions parameters)")
        if self.backend == "torch":
            _check(self.ranks == 1, "learner.ranks", self.ranks,
                   "1 with learner.backend=torch (one process; use deepspeed for several ranks)")
            _check(self.optimizer == "adamw_torch", "learner.optimizer", self.optimizer,
                   "adamw_torch with learner.backend=torch (adamw_deepspeed is DeepSpeed's)")
        per_step = self.micro_batch * self.ranks * self.minibatches
        _check(
            self.batch_size % per_step == 0,
            "learner.batch_size",
            self.batch_size,
            f"divisible by learner.micro_batch ({self.micro_batch}) x learner.ranks "
            f"({self.ranks}) x learner.minibatches ({self.minibatches})",
        )
        if self.kl_mode == "reward" and self.kl_coef > 0:
            _check(
                self.advantage in ("reinforce_pp", "gae"),
                "learner.kl_mode",
                self.kl_mode,
                f"'loss' with learner.advantage={self.advantage} (a per-token KL reward needs "
                "reinforce_pp or gae)",
            )
        for name in ("weight_decay", "grad_clip", "kl_coef", "entropy_coef", "checkpoint_every"):
            _check(getattr(self, name) >= 0, "learner." + name, getattr(self, name), ">= 0")
        for name in ("gamma", "lam"):
            _check(0 <= getattr(self, name) <= 1, "learner." + name, getattr(self, name), "in [0, 1]")


@dataclass(frozen=True)
class StageCosts(_Section):
    """Device-seconds one stage spends per sample on one device (a CPU core running one thread,
    or a GPU), which `placement: auto` sizes the stages from (async_rlhf/launch/placement.py). The
    defaults are the small preset on a 2-core CPU box (README, Benchmarks): the learner ~2.7 s per 64
    samples on one thread under bf16 autocast (5.4 s in float32), vLLM ~1.3 s per 64 with 64
    sequences in flight. `async-rlhf bench`
    measures them (its stage bounds) for its auto settings."""

    _prefix = "stage_costs."
    generator_s: float = 0.02  # one generated sample, in device-seconds
    learner_s: float = 0.042  # one trained sample, in device-seconds

    def _validate(self) -> None:
        self._positive("generator_s", "learner_s")


@dataclass(frozen=True)
class EvalConfig(_Section):
    """Held-out evaluation during training, by a dedicated actor (async_rlhf/launch/roles.py: EvalWorker)."""

    _prefix = "eval."
    every: int = 0  # evaluate policy versions 0, every, 2 x every ... and the last; 0: off
    # a number of prompts drawn from the task's held-out split (actors.tasks.is_heldout), or the
    # path of a JSONL file of records as data.source=jsonl reads them
    prompts: int | str = 64
    samples: int = 0  # also this many samples per prompt at generator.temperature: eval_pass@<samples>
    pass_reward: float = 1.0  # a sample passes (pass@k) with at least this reward
    seed: int = 0  # which held-out prompts are drawn

    def _validate(self) -> None:
        _check(self.every >= 0, "eval.every", self.every, ">= 0 (0: no evaluation)")
        _check(self.samples >= 0, "eval.samples", self.samples, ">= 0")
        if isinstance(self.prompts, int):
            _check(self.prompts > 0, "eval.prompts", self.prompts, "> 0 (or a JSONL path)")
        else:
            _check(Path(self.prompts).is_file(), "eval.prompts", self.prompts,
                   "a prompt count or the path of an existing JSONL file")


@dataclass(frozen=True)
class EnvConfig(_Section):
    """Multi-turn episodes (actors/episodes.py): with a target, every sample is an episode of
    model turns and the environment's observations, trained on the model's tokens only."""

    _prefix = "env."
    # module:Class of the environment, built once per episode with `args` as keyword arguments:
    # reset(prompt) -> first observation; step(turn text) -> (observation, done, reward or
    # None); either may be async. "": no environment, one completion per sample.
    target: str = ""
    args: dict[str, int | float | str | bool] = field(default_factory=dict)  # the class's keyword arguments
    # module:function of an agent (instead of a target; actors/agents.py): `async def agent(client:
    # openai.AsyncOpenAI, prompt) -> reward` (a float, {"reward": float, <part>: float}, or None:
    # the rewards score its last answer), its calls served by the generator's engine
    agent: str = ""
    # one of vLLM's tool parsers (e.g. hermes) for the `tool_calls` of an agent's chat replies;
    # "": replies are plain text
    tool_parser: str = ""
    max_turns: int = 4  # model turns (an agent's calls) per episode; a target's is cut there
    # response tokens per episode: a target's turns and observations together, an agent's sampled ones
    max_tokens: int = 64
    # an environment call (or an agent's whole episode) that takes longer fails its episode: the
    # group is set aside, counted
    timeout_s: float = 30.0
    concurrency: int = 64  # threads for environments' plain (not async) methods, per generator

    def _validate(self) -> None:
        self._positive("max_turns", "max_tokens", "timeout_s", "concurrency")
        _check(not self.target or ":" in self.target, "env.target", self.target,
               "module:Class, e.g. actors.envs:GuessNumber (or empty: no environment)")
        _check(not self.agent or ":" in self.agent, "env.agent", self.agent,
               "module:function, e.g. actors.envs:calculator_agent (or empty: no agent)")
        _check(not (self.agent and self.target), "env.agent", self.agent,
               f"empty while env.target is set ({self.target}): an episode has an environment or an agent")


@dataclass(frozen=True)
class WandbConfig(_Section):
    """Weights & Biases: the step scalars TensorBoard gets and the completions table, to one W&B
    run (`pip install -e ".[wandb]"`; the package is imported only when `project` is set)."""

    _prefix = "log.wandb."
    project: str = ""  # the W&B project; "": no W&B run
    entity: str = ""  # the W&B team or user; "": your default entity
    name: str = ""  # the run's display name; "": the job's name
    # online: sent as it trains (needs `wandb login` or WANDB_API_KEY); offline: written under
    # OUT/wandb only, to upload later with `wandb sync`
    mode: Literal["online", "offline"] = "online"


@dataclass(frozen=True)
class LogConfig(_Section):
    """What a job writes for people to read besides metrics.jsonl and TensorBoard."""

    _prefix = "log."
    # every this many steps, a sample of the groups just trained (prompt, responses, reward parts,
    # advantage, staleness, policy version) to OUT/completions.jsonl, TensorBoard text and W&B; 0: off
    completions_every: int = 10
    completions_groups: int = 2  # groups in each such sample
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def _validate(self) -> None:
        _check(self.completions_every >= 0, "log.completions_every", self.completions_every, ">= 0 (0: off)")
        self._positive("completions_groups")


def _default_rewards() -> tuple[RewardSpec, ...]:
    return (RewardSpec(kind="function", target="actors.tasks:score"),)


@dataclass(frozen=True)
class Config(_Section):
    job: str = "async-rlhf"  # the job's name: its Ray namespace and what `status`/`stop --job` take
    out: str = "runs/demo"  # output directory: metrics.jsonl, summary.json, checkpoints, the exported policy
    seed: int = 0  # seeds prompts, sampling and the learner
    max_staleness: int = 2  # k: a trajectory may be at most k policy versions old when trained on
    # auto: generator.count/threads and learner.ranks/threads sized from stage_costs to this
    # machine (async_rlhf/launch/placement.py), then ZeRO stage, gradient checkpointing and ranks
    # chosen so the job's estimated peak memory fits this node (launch/memory.py), all printed at
    # start; manual: as the config gives them, refused before start if the estimate does not fit;
    # colocated: as manual, with every part on the launcher's node sharing its devices (on a GPU:
    # one generator engine and one learner rank share it) and weights passed through shared memory
    # (CUDA IPC on GPU) instead of a broadcast. auto picks colocated on a machine of one GPU.
    placement: Literal["manual", "auto", "colocated"] = "auto"
    stage_costs: StageCosts = field(default_factory=StageCosts)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: tuple[RewardSpec, ...] = field(default_factory=_default_rewards)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def _validate(self) -> None:
        _check(self.max_staleness >= 0, "max_staleness", self.max_staleness, ">= 0")
        # a lag beyond k: generators would wait for slots that only data they cannot make frees
        _check(self.generator.weight_lag <= self.max_staleness, "generator.weight_lag",
               self.generator.weight_lag, f"<= max_staleness ({self.max_staleness})")
        _check(not (self.eval.every and isinstance(self.eval.prompts, int) and self.data.source != "task"),
               "eval.prompts", self.eval.prompts,
               f"a JSONL path with data.source={self.data.source} (only built-in tasks have a held-out split)")
        _check(len(self.rewards) > 0, "rewards", self.rewards, "a non-empty list")
        # The staleness gate admits whole groups; a learner batch that is no whole number of
        # groups would split one (GRPO baselines need all of a group's samples).
        _check(
            self.learner.batch_size % self.generator.group_size == 0,
            "learner.batch_size",
            self.learner.batch_size,
            f"a multiple of generator.group_size ({self.generator.group_size})",
        )
        if self.data.source == "preferences":  # one producer puts the file's pairs, in groups of 2
            _check(self.learner.algorithm == "dpo", "learner.algorithm", self.learner.algorithm,
                   "dpo with data.source=preferences (the file holds pairs, no rewards to optimise)")
            _check(self.generator.group_size == 2, "generator.group_size", self.generator.group_size,
                   "2 with data.source=preferences (a group is one pair)")
            _check(self.generator.count == 1, "generator.count", self.generator.count,
                   "1 with data.source=preferences (one producer reads the file; more would repeat it)")
            _check(self.placement == "manual", "placement", self.placement,
                   "manual with data.source=preferences (no generation to size stages for: the "
                   "one producer needs no core of its own; set learner.threads/ranks by hand)")
        if self.env.target or self.env.agent:
            self._validate_episodes()
        if self.learner.overlong == "soft":  # the penalty ramps over the buffer's last tokens
            _check(0 < self.learner.overlong_buffer < self.response_limit, "learner.overlong_buffer",
                   self.learner.overlong_buffer, f"in 1..{self.response_limit - 1} with learner.overlong=soft "
                   f"(tokens before the response limit, {self.response_limit}, where the penalty starts)")
        if self.learner.algorithm == "dpo":  # a pair is two responses to one prompt
            _check(self.generator.group_size >= 2, "generator.group_size", self.generator.group_size,
                   ">= 2 with learner.algorithm=dpo (a pair is two responses of one group)")
            # the chosen and rejected responses of a pair meet in one forward pass
            _check(self.learner.micro_batch % self.generator.group_size == 0, "learner.micro_batch",
                   self.learner.micro_batch, f"a multiple of generator.group_size ({self.generator.group_size}) "
                   "with learner.algorithm=dpo (a micro-batch holds whole groups)")

    @property
    def response_limit(self) -> int:
        """The most tokens a response may have: env.max_tokens for episodes (an agent's
        calls sample at most that many; the text between them comes on top), else
        generator.max_new_tokens."""
        return self.env.max_tokens if self.env.target or self.env.agent else self.generator.max_new_tokens

    def _validate_episodes(self) -> None:
        why = f"with env.target={self.env.target!r} (episodes)" if self.env.target else \
            f"with env.agent={self.env.agent!r} (episodes)"
        _check(self.generator.engine == "vllm", "generator.engine", self.generator.engine,
               f"vllm {why}: their turns are continuously batched")
        _check(self.learner.algorithm == "ppo", "learner.algorithm", self.learner.algorithm,
               f"ppo {why}")
        _check(self.data.source != "preferences", "data.source", self.data.source,
               f"a prompt source {why}")

    def to_yaml(self) -> str:
        """The resolved config as YAML, fit to print or keep (a Redis password is redacted)."""
        resolved = dataclasses.asdict(self)
        if self.queue.redis_url:  # the url and password stay in the job record (0600) only
            resolved["queue"]["redis_url"] = redact_url(self.queue.redis_url)
        return yaml.safe_dump(resolved, sort_keys=False)

    @staticmethod
    def json_schema() -> dict[str, Any]:
        """JSON schema of the config file (types, allowed values, defaults); the checks that
        relate keys to each other are in each section's _validate."""
        from pydantic import TypeAdapter

        return TypeAdapter(Config).json_schema()


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "generator": GeneratorConfig,
    "queue": QueueConfig,
    "learner": LearnerConfig,
    "stage_costs": StageCosts,
    "eval": EvalConfig,
    "env": EnvConfig,
    "log": LogConfig,
    "log.wandb": WandbConfig,
}


_RETIRED = {  # dotted key -> what replaces it
    "generator.prompts_per_batch": "generators stream groups now; set generator.max_inflight "
    "(sequences in the engine, the old prompts_per_batch x group_size) and, for the old "
    "lock-step batches, generator.schedule=lockstep",
}


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {raw!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    for key in unknown:
        if where + key in _RETIRED:
            raise ConfigError(f"config key {where}{key} is retired: {_RETIRED[where + key]}")
    if unknown:
        raise ConfigError(
            f"unknown config key {where}{unknown[0]!r}; allowed keys here: {', '.join(sorted(names))}"
        )
    kwargs = dict(raw)
    hints = typing.get_type_hints(cls)
    for name in kwargs:  # a section, at any depth (log.wandb)
        if isinstance(hints[name], type) and issubclass(hints[name], _Section):
            kwargs[name] = _build(hints[name], kwargs[name], f"{where}{name}.")
    if cls is Config and "rewards" in kwargs:
        specs = kwargs["rewards"]
        if not isinstance(specs, list):
            raise ConfigError(f"rewards must be a list of mappings, got {specs!r}")
        kwargs["rewards"] = tuple(_reward(i, spec) for i, spec in enumerate(specs))
    return cls(**kwargs)


def _reward(i: int, raw: Any) -> RewardSpec:
    """rewards[i]; its errors name the key as the YAML spells it (RewardSpec says reward.KEY)."""
    try:
        return _build(RewardSpec, raw, f"rewards[{i}].")
    except ConfigError as e:
        raise ConfigError(str(e).replace(RewardSpec._prefix, f"rewards[{i}].", 1)) from None


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted}: {part} is not a section")
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`learner.lr=1e-5` -> ("learner.lr", 1e-05); values are parsed as YAML scalars."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like key=value, e.g. learner.lr=1e-5")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: its value is not valid YAML ({' '.join(str(e).split())})") from None
    if isinstance(parsed, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    return key.strip(), parsed


_PLACED = (("generator", "count"), ("generator", "threads"), ("learner", "ranks"), ("learner", "threads"))


def load_config(path: str | os.PathLike | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Build the config from a YAML file (or the defaults) plus `key=value` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    for text in overrides:
        _set_dotted(raw, *parse_override(text))
    try:
        cfg = _build(Config, raw, "")
    except TypeError as e:  # a section given where a scalar belongs, or the reverse
        raise ConfigError(str(e)) from None
    if cfg.placement == "auto":  # it sizes these: a value given for one would be overridden
        for section, key in _PLACED:
            given = raw.get(section)
            _check(not (isinstance(given, dict) and key in given), f"{section}.{key}", given and given.get(key),
                   "left out with placement: auto, which sizes it (or set placement: manual)")
    return cfg

