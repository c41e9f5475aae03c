"""Models and data made offline, without a download: the model presets and random groups.

Presets: the shapes of the random-init Llama-style models every part builds from. Parameter
counts with the character vocabulary (50 tokens; `test_actors_model_init` checks the ranges):
  tiny  ~0.9M   (hidden 128, 4 layers)   tests and the demo
  small ~38.6M  (hidden 512, 12 layers)  benchmarks
`async-rlhf init-model` (actors/model_init.py) writes one to disk with its tokenizer; the learner
tests and bench-learner build one in memory.

`random_groups` is the one maker of synthetic scored trajectories, for the learner and queue
benches and the learner tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from async_rlhf.types import Group, Trajectory

# The character tokenizer's vocabulary (actors/model_init.py): these ids 0..3, then one token per
# character, everything the built-in tasks write (digits, letters, space and a few marks).
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz :=,.?!-+>"
CHAR_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, max_positions=256),
    "small": Preset(hidden_size=512, num_layers=12, num_heads=8, intermediate_size=1408, max_positions=512),
}


# The model families a random-init model can be built as (`family`), each with what sets it
# apart in the weight path and the learner: tied output layers, fused or biased projections,
# norms on q and k, softcapped attention and sliding windows, GPT-2's Conv1D and dropout.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "gpt2")


def family_config(family: str, p: Preset, vocab_size: int):
    """A transformers config of `family` in preset `p`'s shape, with the character tokenizer's
    special ids. Llama (the presets' family) and Mistral and Phi-3 untie their output layer; the
    others tie it, as their small models do (GQA where the family has it)."""
    import transformers as tf

    heads = p.num_heads
    ids = dict(pad_token_id=SPECIAL_TOKENS.index(PAD), bos_token_id=SPECIAL_TOKENS.index(BOS),
               eos_token_id=SPECIAL_TOKENS.index(EOS))
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=vocab_size, n_embd=p.hidden_size, n_layer=p.num_layers, n_head=heads,
                             n_positions=p.max_positions, **ids)  # dropout 0.1 and tied, as GPT-2's own
    shape = dict(vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                 num_hidden_layers=p.num_layers, num_attention_heads=heads, max_position_embeddings=p.max_positions,
                 **ids)
    head_dim = dict(head_dim=p.hidden_size // heads)
    configs = {
        "llama": lambda: tf.LlamaConfig(**shape, num_key_value_heads=heads, tie_word_embeddings=False),
        "qwen2": lambda: tf.Qwen2Config(**shape, num_key_value_heads=heads // 2, tie_word_embeddings=True),
        "qwen3": lambda: tf.Qwen3Config(**shape, **head_dim, num_key_value_heads=heads // 2, tie_word_embeddings=True),
        "mistral": lambda: tf.MistralConfig(**shape, num_key_value_heads=heads // 2, tie_word_embeddings=False),
        "gemma": lambda: tf.GemmaConfig(**shape, **head_dim, num_key_value_heads=heads // 2),
        "gemma2": lambda: tf.Gemma2Config(**shape, **head_dim, num_key_value_heads=heads // 2,
                                          query_pre_attn_scalar=p.hidden_size // heads, sliding_window=16),
        "phi3": lambda: tf.Phi3Config(**shape, num_key_value_heads=heads // 2, tie_word_embeddings=False),
    }
    if family not in configs:
        raise ValueError(f"unknown model family {family!r}: choose one of {', '.join(FAMILIES)}")
    return configs[family]()


def build_model(preset: str, seed: int = 0, vocab_size: int = CHAR_VOCAB_SIZE, family: str = "llama"):
    """A random-init float32 causal LM of `preset`'s shape and `family` (transformers, offline),
    with the character tokenizer's pad/bos/eos ids."""
    import torch
    from transformers import AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}: choose one of {', '.join(PRESETS)}")
    config = family_config(family, PRESETS[preset], vocab_size)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def random_groups(
    n: int,
    *,
    vocab: int,
    prompt_len: int = 8,
    response_len: int = 8,
    group_size: int = 4,
    version: int = 0,
    seed: int = 0,
    min_response_len: int | None = None,
) -> list[Group]:
    """n groups of group_size finished trajectories: token ids in [3, vocab) (no special ids
    below 3), behaviour log-probs in [-6, -0.5], reward = the fraction of even response tokens.
    Responses are response_len tokens, or with min_response_len, of lengths drawn uniformly
    from min_response_len to response_len."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n * group_size):
        length = response_len if min_response_len is None else int(rng.integers(min_response_len, response_len + 1))
        resp = rng.integers(3, vocab, length).astype(np.int32)
        out.append(Trajectory(
            prompt_ids=rng.integers(3, vocab, prompt_len).astype(np.int32),
            response_ids=resp,
            behavior_logprobs=(-rng.uniform(0.5, 6.0, length)).astype(np.float32),
            reward=float(np.mean(resp % 2 == 0)),
            reward_parts={"even": float(np.mean(resp % 2 == 0))},
            policy_version=version,
            generator_id="gen-0",
            group_id=f"s{seed}-g{i // group_size}",
            finished=True,
        ))
    return [Group(tuple(out[g:g + group_size])) for g in range(0, len(out), group_size)]
