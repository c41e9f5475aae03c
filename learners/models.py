"""The models a train backend holds, whatever runs them: the policy, a frozen reference and a
critic, loaded the same way for every backend, and the response log-probs and values read off
them (HeldModels, the part of TrainBackend that does not train). Shapes: input_ids,
attention_mask [B, L]; positions [B, T], the index of the logit that predicts each response
token (prompt_len - 1 + t).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from async_rlhf.config import LearnerConfig
from async_rlhf.devices import bf16_native
from learners.batch import pack_rows, packed
from learners.losses import entropy_from_logits, token_logprobs

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Rows up to this long train faster with SDPA's math kernel on CPU: one thread, the small
# preset, 16 rows, bf16 autocast, a step took 0.82-0.88 s against 0.89-0.96 s with the flash
# kernel at 30 tokens, as long at 128, 7% longer at 256 (2-core VM, 2026-12-03)
MATH_ATTENTION_TOKENS = 128
# Logits per chunk of the LM head (tokens x vocabulary): a chunk's float32 logits are 32 MiB
# whatever the vocabulary (55 tokens of Qwen2.5's 151,936; all of a batch's tokens of the presets'
# 50), and so is each copy the loss makes of them (log-softmax, entropy, their gradients)
LOGIT_CHUNK_ELEMENTS = 1 << 23
# A micro-batch is packed (learner.packing) only where that computes this share fewer positions
# than its padded rows: rows of like length gain nothing from it, and short ones lose. Packed,
# 16 sorted rows of 24-28 tokens took 1.00 s a pair of micro-batches against 0.83-0.86 s padded
# (more positions: bins of 128 leave tails); of 16-84 tokens, 1.55 s against 1.86 s (padding
# 16% of positions instead of 25%). Small preset, bf16 autocast, 2 threads, forward and
# backward (2-core AMD EPYC with avx512_bf16, 2026-12-06)
PACK_MIN_SAVING = 0.1


def default_device() -> str:
    """This rank's GPU (LOCAL_RANK) where CUDA is, else the CPU."""
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"


def autocast_dtype(mode: str, device: str, weights: torch.dtype) -> torch.dtype | None:
    """The dtype forward passes autocast to under learner.mixed_precision=`mode` (None: none).
    Weights already in bf16 need none."""
    if weights != torch.float32 or mode == "fp32" or (mode == "auto" and not bf16_native(device)):
        return None
    return torch.bfloat16


def reference_dtype(cfg: LearnerConfig, device: str, weights: torch.dtype) -> torch.dtype:
    """The frozen reference's weight dtype: learner.reference_dtype, where auto is bfloat16 when
    forward passes autocast to it (its matrix products then round the weights to bf16 anyway),
    else the policy's weight dtype."""
    if cfg.reference_dtype == "auto":
        return autocast_dtype(cfg.mixed_precision, device, weights) or weights
    return DTYPES[cfg.reference_dtype]


def adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW, fused (one kernel over all parameters, on CPU and GPU alike): 3-4x faster
    than its per-parameter loop on the small preset on one CPU thread."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


def _attn_implementation(device: str, want_flash: bool, dtype: torch.dtype, config) -> str:
    """flash-attention 2 on a GPU where installed (16-bit only), else SDPA; but SDPA drops the
    attention logits' softcapping (Gemma-2's `attn_logit_softcapping`), which vLLM applies: such
    a model runs transformers' eager attention, which keeps it (sliding windows SDPA keeps, in
    its mask)."""
    if device.startswith("cuda") and want_flash and dtype != torch.float32:
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    text = getattr(config, "text_config", None) or config
    return "eager" if getattr(text, "attn_logit_softcapping", None) else "sdpa"


def disable_dropout(model: nn.Module) -> nn.Module:
    """Dropout off in every forward, in training mode too (as TRL's disable_dropout, its
    default): vLLM samples without it, so pi_theta, pi_prox and the behaviour log-probs are of one
    distribution. Both kinds: nn.Dropout modules (GPT-2's), and the rate attention layers apply
    functionally in training mode (Llama and kin: `attention_dropout`). The config is left alone:
    the exported policy keeps the user's."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


class ValueModel(nn.Module):
    """Critic: a transformer backbone and a linear value head, one value per position.

    Built from AutoModelForSequenceClassification (num_labels=1), so a reward model's backbone
    and score head initialise it when one is given (as OpenRLHF does); from a policy
    checkpoint, the head starts fresh.
    """

    def __init__(self, path: str, dtype: torch.dtype, attn: str):
        super().__init__()
        from transformers import AutoModelForSequenceClassification

        rm = disable_dropout(AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, attn_implementation=attn
        ))
        self.backbone = rm.base_model
        self.head = rm.score

    def forward(self, input_ids, attention_mask, position_ids=None):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1).float()  # [B, L]


@dataclass
class Models:
    policy: nn.Module  # float32, on the CPU: the backend places and wraps it
    reference: nn.Module | None  # frozen, in reference_dtype on the device (kl_coef > 0, dpo)
    critic: ValueModel | None  # float32, on the CPU (advantage == "gae")


def load_models(cfg: LearnerConfig, policy: str | nn.Module, device: str, dtype: torch.dtype,
                sharded: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Models:
    """The policy from an HF directory (or an already built causal LM: benchmarks, tests), a
    frozen copy as reference when learner.kl_coef > 0 or learner.algorithm is dpo, and a critic
    when learner.advantage is gae (from learner.critic_init, else the policy directory). The
    trained models (policy, critic) are built inside `sharded()` (ZeRO-3: partitioned as they
    are built, deepspeed_backend.zero3_init); the reference outside it, whole."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = policy.config if isinstance(policy, nn.Module) else AutoConfig.from_pretrained(policy)
    attn = _attn_implementation(device, cfg.flash_attention, dtype, config)

    def load(path_or_model: str | nn.Module) -> nn.Module:
        if isinstance(path_or_model, nn.Module):
            return disable_dropout(path_or_model)
        return disable_dropout(AutoModelForCausalLM.from_pretrained(path_or_model, dtype=torch.float32,
                                                                    attn_implementation=attn))

    with sharded():
        model = load(policy)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = None  # replicated (not sharded) on every rank
    if cfg.kl_coef > 0 or cfg.algorithm == "dpo":
        ref = load(policy) if isinstance(policy, str) else copy.deepcopy(model)
        reference = ref.to(device, reference_dtype(cfg, device, dtype)).eval().requires_grad_(False)
    critic = None
    if cfg.advantage == "gae":
        path = cfg.critic_init or (policy if isinstance(policy, str) else "")
        if not path:
            raise ValueError(
                "advantage=gae needs a critic: set learner.critic_init to a reward-model "
                "directory, or give the policy as a directory"
            )
        with sharded():
            critic = ValueModel(path, torch.float32, attn)
        if cfg.gradient_checkpointing:
            critic.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return Models(model, reference, critic)


def _packed_positions(bins: list[list[int]], lengths: list[int]) -> int:
    """Positions computed over rows of `lengths` packed into `bins`: as many rows as bins, each
    as long as the fullest."""
    return len(bins) * max(sum(lengths[r] for r in rows) for rows in bins)


def response_view(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Pick per-position outputs x [B, L, ...] at positions [B, T] -> [B, T, ...]."""
    idx = positions.view(*positions.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, idx)


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response tokens) [B, T] (and entropy [B, T]) of a causal LM at `temperature`.
    Gradient flows under grad mode; into the entropy only with entropy_grad (otherwise it is a
    metric and keeps no graph). With `position_ids`, rows are packed (batch.packed):
    attention_mask is None and `positions` index the rows of input_ids laid end to end.

    No [B, T, vocab] logits exist whole, in forward or backward: the model runs to its last
    hidden state (its own LM head on one position only), and the head is applied to
    LOGIT_CHUNK_ELEMENTS // vocab response tokens at a time, each chunk's logits made again in the backward
    rather than kept (activation checkpointing of the head). The model is called whole (an engine
    wrapping it keeps its forward hooks); `hidden_states[-1]` is the final-normed state the head
    reads in every family (transformers' capture_outputs ties it to last_hidden_state)."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                   output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    shape = positions.shape
    if position_ids is not None:  # packed: the bins end to end
        hidden, input_ids, positions = hidden.reshape(1, -1, hidden.shape[-1]), input_ids.reshape(1, -1), positions.reshape(1, -1)
    hidden = response_view(hidden, positions)  # [B, T, H]
    targets = input_ids.gather(1, positions + 1)
    head = LogitHead(getattr(model, "module", model), temperature)
    rows = max(1, LOGIT_CHUNK_ELEMENTS // head.vocab_size)
    flat_h, flat_t = hidden.flatten(0, 1), targets.flatten()
    chunks = []
    for s in range(0, flat_t.numel(), rows):
        args = (flat_h[s:s + rows], flat_t[s:s + rows], with_entropy, entropy_grad)
        if torch.is_grad_enabled():
            chunks.append(checkpoint(head, *args, use_reentrant=False))
        else:
            chunks.append(head(*args))
    logp = torch.cat([c[0] for c in chunks]).view(shape)
    entropy = torch.cat([c[1] for c in chunks]).view(shape) if with_entropy else None
    return logp, entropy


class LogitHead:
    """A causal LM's output layer on a chunk of hidden states [N, H]: the log-prob of each target
    [N] (and the entropy [N]) at `temperature`, with the logits float32 as the loss reads them.
    Gemma-2's final logit softcapping (cap * tanh(z / cap)) is applied as its model applies it."""

    def __init__(self, lm: nn.Module, temperature: float):
        self.linear = lm.get_output_embeddings()
        text = getattr(lm.config, "text_config", None) or lm.config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.vocab_size = text.vocab_size
        self.temperature = temperature

    def __call__(self, hidden, targets, with_entropy: bool, entropy_grad: bool):
        logits = self.linear(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits / self.temperature
        logp = token_logprobs(logits, targets)
        entropy = None
        if with_entropy:
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
        return logp, entropy


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode without gradients, back in training mode after."""
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train()


class HeldModels:
    """The read side of async_rlhf.protocols.TrainBackend, the same for every backend. A backend
    sets `model` (the policy, an HF causal LM), `run_policy` (what computes its forward: the
    model, or an engine wrapping it), `reference`, `critic` (a module or engine, or None) and
    `temperature` (the generators' sampling temperature), `device`, `autocast` (the dtype
    forward passes autocast to, from autocast_dtype, or None) and `cfg`."""

    model: nn.Module
    run_policy: nn.Module
    reference: nn.Module | None
    critic: nn.Module | None
    temperature: float
    device: str
    autocast: torch.dtype | None
    cfg: LearnerConfig
    _packing: bool | None = None  # learner.packing in effect, once _packs has checked

    def _forward(self, tokens: int) -> contextlib.ExitStack:
        """The context of a forward pass over `tokens` positions: autocast to self.autocast, and
        on CPU for at most MATH_ATTENTION_TOKENS, SDPA's math kernel rather than its flash one,
        whose backward has a fixed cost that dominates short rows. Not with gradient checkpointing:
        its recomputation runs in the backward, outside this context, and must meet the kernel
        the forward used."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device.split(":")[0], dtype=self.autocast or torch.float32,
                                           enabled=self.autocast is not None))
        if self.device == "cpu" and tokens <= MATH_ATTENTION_TOKENS and not self.model.is_gradient_checkpointing:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        return stack

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, *,
                 reference: bool = False, with_entropy: bool = False,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log pi(response tokens) [B, T] (and entropy [B, T]) at the sampling temperature, of the
        policy or the frozen reference (response_logprobs), over rows packed where _packs."""
        model = self.reference if reference else self.run_policy
        if model is None:
            raise ValueError("no reference model: it is loaded only when learner.kl_coef > 0")
        ids, mask, position_ids, positions = self._layout(input_ids, attention_mask, positions)
        with self._forward(ids.shape[1]):
            return response_logprobs(model, ids, mask, positions, self.temperature, with_entropy=with_entropy,
                                     entropy_grad=entropy_grad, position_ids=position_ids)

    def values(self, input_ids, attention_mask, positions) -> torch.Tensor:
        """Critic values [B, T] of the states before each response token."""
        ids, mask, position_ids, index = self._layout(input_ids, attention_mask, positions)
        with self._forward(ids.shape[1]):
            values = self.critic(ids, mask, position_ids)
        return response_view(values, index) if position_ids is None else values.flatten()[index]

    def forward_positions(self, attention_mask: torch.Tensor) -> int:
        """The positions a forward over these rows computes, padding included."""
        bins = self._bins(attention_mask)
        return attention_mask.numel() if bins is None else _packed_positions(bins, attention_mask.sum(1).tolist())

    def _layout(self, input_ids, attention_mask, positions):
        """(input_ids, attention_mask, position_ids, positions) as the forward takes them: the rows
        packed (position_ids set, no mask) where _bins says so, else as they are."""
        bins = self._bins(attention_mask)
        if bins is None:
            return input_ids, attention_mask, None, positions
        ids, position_ids, index = packed(input_ids, attention_mask, positions, bins)
        return ids, None, position_ids, index

    def _bins(self, attention_mask: torch.Tensor) -> list[list[int]] | None:
        """The rows packed into rows of at most _pack_cap() tokens (pack_rows), or None: packing is
        off, or it would not compute PACK_MIN_SAVING fewer positions than the padded rows."""
        if not self._packs():
            return None
        lengths = attention_mask.sum(1).tolist()
        bins = pack_rows(lengths, self._pack_cap())
        return bins if _packed_positions(bins, lengths) <= (1 - PACK_MIN_SAVING) * attention_mask.numel() else None

    def _pack_cap(self) -> int | None:
        """The most tokens packed into one row: unbounded with flash-attention's varlen kernels;
        else MATH_ATTENTION_TOKENS. SDPA attends over a packed row of C tokens with a dense
        [C, C] mask, and past that length with its slower masked kernel: rows of 16-84 tokens
        (a `length` micro-batch of 16, small preset, forward and backward, 2 threads) took 0.76
        s packed into rows of 128 tokens, 0.85 s into 256, 1.07 s into 512 and 1.05 s padded
        under bf16 autocast; 1.32, 1.49, 1.83 and 1.90 s in float32 (2-core AMD EPYC with
        avx512_bf16, 2026-12-06)."""
        return None if self.model.config._attn_implementation == "flash_attention_2" else MATH_ATTENTION_TOKENS

    def _packs(self) -> bool:
        """learner.packing, and this model's attention keeps packed rows apart: checked once, on
        two short rows, packed against padded (a family whose masks ignore packed position ids
        would mix the rows: it trains padded, with a warning)."""
        if self._packing is None:
            self._packing = self.cfg.packing and self._packing_matches_padding()
            if self.cfg.packing and not self._packing:
                log.warning("learner.packing: %s's attention mixes packed rows; training on padded rows",
                            type(self.model).__name__)
        return self._packing

    def _packing_matches_padding(self) -> bool:
        """Two rows (8 and 5 tokens) packed give the log-probs they give padded, within a tenth
        of what the second row's log-probs move when it attends to the first (dropout is off in
        every model here, so no mode switch is needed)."""
        ids = torch.arange(1, 9, device=self.device).view(1, 8) % self.vocab_size
        input_ids = torch.cat([ids, ids.flip(1)])
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 5:] = 0
        positions = torch.arange(1, 4, device=self.device).repeat(2, 1)
        with torch.no_grad(), self._forward(input_ids.shape[1]):
            want = response_logprobs(self.run_policy, input_ids, attention_mask, positions, 1.0)[0]
            ids, position_ids, index = packed(input_ids, attention_mask, positions, [[0, 1]])
            got, mixed = (response_logprobs(self.run_policy, ids, mask, index, 1.0, position_ids=position_ids)[0]
                          for mask in (None, torch.ones_like(ids)))  # packed; one sequence
        return bool((got - want).abs().max() <= 0.1 * (mixed - want).abs().max())

    def inference(self) -> contextlib.AbstractContextManager[None]:
        """The policy in eval mode, without gradients (pi_prox, reference, critic passes)."""
        return evaluating(self.run_policy)
