"""init-model: presets build offline with the advertised sizes, and a tokenizer that round-trips."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.model_init import ensure_model, init_model
from async_rlhf.launch.cli import main
from async_rlhf.synthetic import CHARACTERS, build_model


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_preset_sizes():
    assert 0.5e6 <= _params(build_model("tiny")) <= 1.5e6
    assert 25e6 <= _params(build_model("small")) <= 40e6


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="unknown model preset 'huge': choose one of tiny, small"):
        build_model("huge")


def test_tokenizer_round_trip(tiny_actor_model):
    tok = AutoTokenizer.from_pretrained(tiny_actor_model)
    ids = tok("copy 3142=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("copy 3142=")
    assert tok.decode(ids, skip_special_tokens=True) == "copy 3142="
    assert tok.decode(tok(CHARACTERS)["input_ids"], skip_special_tokens=True) == CHARACTERS
    assert {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id} == {0, 1, 2}
    model = AutoModelForCausalLM.from_pretrained(tiny_actor_model)
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id


def test_ensure_model_builds_once(tmp_path):
    path = ensure_model(tmp_path / "m", "tiny", seed=1)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(path, "tiny", seed=1) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt


def test_same_seed_same_weights(tmp_path):
    a = build_model("tiny", seed=3).state_dict()
    b = build_model("tiny", seed=3).state_dict()
    assert all((a[k] == b[k]).all() for k in a)


def test_cli(tmp_path, capsys):
    assert main(["init-model", "--preset", "tiny", "--out", str(tmp_path / "cli"), "--seed", "2"]) == 0
    assert "tiny llama model: 0.87M parameters" in capsys.readouterr().out
    assert main(["init-model", "--family", "qwen2", "--out", str(tmp_path / "qwen2")]) == 0
    assert "tiny qwen2 model" in capsys.readouterr().out
    assert init_model  # the function the CLI wraps is importable for the launcher


def test_bench_gen_smoke(tiny_actor_model, tmp_path, capsys):
    out = tmp_path / "gen.json"
    argv = ["bench-gen", "--preset", "tiny", "--model", str(tiny_actor_model), "--prompts", "4",
            "--max-new-tokens", "4", "--repeats", "1", "--engines", "hf", "--hf-threads", "1",
            "--out", str(out)]
    assert main(argv) == 0
    import json

    report = json.loads(out.read_text())
    (hf,) = report["results"]
    assert hf["engine"] == "hf" and hf["threads"] == 1 and hf["runs"][0]["tokens"] > 0
    assert "tok/s/thread" in capsys.readouterr().out
