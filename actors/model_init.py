"""`async-rlhf init-model`: a random-init Llama-style model and a tokenizer, built offline.

No hub access exists here, so tests, the demo and the benchmarks build their own model. The
tokenizer is character-level over the characters the built-in tasks use (actors.tasks): every
character is one token, decoding concatenates them, and `<bos>` is prepended to every encoding.

Presets (parameter counts with this vocabulary; `test_actors_model_init` checks the ranges):
  tiny  ~0.9M  (hidden 128, 4 layers)  for tests and the demo
  small ~38M   (hidden 512, 12 layers) for benchmarks
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3
# Everything the built-in tasks write (digits, letters, space and a few marks), one token each.
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz :=,.?!-+>"


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


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast with <bos>/<eos>/<pad>/<unk>."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    # BPE without merges splits text into single characters; no pre-tokenizer, so spaces are
    # ordinary characters, and the Fuse decoder joins tokens without inserting anything.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left",
    )


def build_model(preset: str, seed: int = 0, vocab_size: int | None = None):
    """A random-init LlamaForCausalLM (float32) for `preset`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}: choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    vocab_size = vocab_size or len(SPECIAL_TOKENS) + len(CHARACTERS)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_heads,
        max_position_embeddings=p.max_positions,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def init_model(out: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Build model + tokenizer into `out` (overwriting); returns the directory."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(preset, seed, vocab_size=len(tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "async_rlhf_model.json").write_text(json.dumps({"preset": preset, "seed": seed}) + "\n")
    return out


def ensure_model(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Return `path`, building the model there first if it holds no model yet."""
    path = Path(path)
    if not (path / "config.json").is_file():
        init_model(path, preset, seed)
    return path


def count_parameters(path: str | Path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    out = init_model(args.out, args.preset, args.seed)
    print(f"{args.preset} model: {count_parameters(out) / 1e6:.2f}M parameters -> {out}")
    return 0
