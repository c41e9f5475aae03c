"""`async-rlhf init-model`: a random-init Llama-style model and a tokenizer, built offline.

No hub access exists here, so tests, the demo and the benchmarks build their own model. Two
tokenizers:
  char  character-level over the characters the built-in tasks use (actors.tasks): every
        character is one token, decoding concatenates them, and `<bos>` is prepended to every
        encoding. No chat template.
  bpe   byte-level BPE trained here (a few hundred merges) on text from the built-in tasks and
        chat markup, as real instruct models' tokenizers are: tokens merge across word and
        prompt/response boundaries, and decoding is not a plain join. It carries a ChatML chat
        template; `<|im_end|>` ends an assistant turn and is the EOS the model stops at.

The presets (tiny, small) and the character vocabulary are async_rlhf/synthetic.py's, shared
with the learner tests and bench-learner.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from async_rlhf.hub import resolve_model
from async_rlhf.synthetic import BOS, CHARACTERS, EOS, FAMILIES, PAD, PRESETS, SPECIAL_TOKENS, UNK, build_model

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen and others write it, with <bos> first as Llama 3's template does.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BPE_VOCAB_SIZE = 512


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


def build_bpe_tokenizer(seed: int = 0):
    """A byte-level BPE PreTrainedTokenizerFast trained offline (see the module docstring), with
    <bos> prepended to plain encodings, <|im_end|> as EOS and the ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from actors.tasks import TASKS, examples

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, IM_END, IM_START, UNK]
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [f"{IM_START}user\n{text}{IM_END}\n{IM_START}assistant\n{answer} {answer}{IM_END}"
              for task in sorted(TASKS) if not TASKS[task].env  # the merges predate the episode tasks
              for text, answer in examples(task, seed, 500)]
    core.train_from_iterator(corpus, trainer)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, core.token_to_id(BOS))])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=IM_END, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[IM_START], padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def init_model(out: str | Path, preset: str = "tiny", seed: int = 0, tokenizer: str = "char",
               family: str = "llama") -> Path:
    """Build model (of `family`: async_rlhf.synthetic.FAMILIES) + tokenizer (char or bpe) into
    `out` (overwriting); returns the directory."""
    if tokenizer not in ("char", "bpe"):
        raise ValueError(f"unknown tokenizer {tokenizer!r}: choose char or bpe")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer() if tokenizer == "char" else build_bpe_tokenizer(seed)
    model = build_model(preset, seed, vocab_size=len(tok), family=family)
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.bos_token_id = tok.pad_token_id, tok.bos_token_id
        config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "async_rlhf_model.json").write_text(
        json.dumps({"preset": preset, "seed": seed, "tokenizer": tokenizer, "family": family}) + "\n")
    return out


def ensure_model(path: str | Path, preset: str | None = "tiny", seed: int = 0, tokenizer: str = "char") -> Path:
    """The model directory `path` names: `path`, where the model is built first if it holds no
    model yet and a preset is given (a random-init model is built only when asked for); without
    a preset, a Hub id's snapshot in this node's cache (async_rlhf.hub)."""
    if (Path(path) / "config.json").is_file():
        return Path(path)
    if preset is not None:
        return init_model(path, preset, seed, tokenizer)
    resolved = Path(resolve_model(str(path)))
    if not (resolved / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path {str(path)!r} holds no model (no config.json): point it at a Hugging Face model "
            "directory or Hub id, or set model.preset=tiny (or small) to build a random-init one there")
    return resolved


def count_parameters(path: str | Path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", choices=["char", "bpe"], default="char")
    parser.add_argument("--family", choices=FAMILIES, default="llama",
                        help="the architecture: tied output layers, GQA, softcapping... as the family has them")


def run(args: argparse.Namespace) -> int:
    out = init_model(args.out, args.preset, args.seed, args.tokenizer, args.family)
    print(f"{args.preset} {args.family} model: {count_parameters(out) / 1e6:.2f}M parameters -> {out}")
    return 0
