"""`train` checks what its config names before anything starts: a reward target that does not
resolve, a JSONL with a broken line, a model directory that is not there (and no preset asked
for) or has no tokenizer, a Hub id that is not cached where nothing can be downloaded, a model
family the job cannot train (mixture of experts), a chat without a template or with one that
rejects data.system_prompt. Each ends the command with exit 2 and one
line naming the value and the fix, before Ray, Redis or an engine starts (OUT is never created)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import MixtralConfig, Qwen3MoeConfig

from async_rlhf.config import ConfigError, load_config
from async_rlhf.launch.preflight import preflight
from helpers import cache_hub_model


def _train(tmp_path, *overrides, config=None, env=()):
    cmd = [sys.executable, "-m", "async_rlhf.launch.cli", "train", "--out", str(tmp_path / "out")]
    if config:
        cmd += ["--config", str(config)]
    env = {**os.environ, "ASYNC_RLHF_HOME": str(tmp_path / "home"), **dict(env)}
    done = subprocess.run([*cmd, *overrides], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert not (tmp_path / "out").exists(), "the job started before the check"
    return done


def _one_line_error(done) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    return done.stderr


@pytest.mark.parametrize("target, expected", [
    ("myreward:nope", "module myreward has no 'nope'"),
    ("nosuchmodule:score", "No module named 'nosuchmodule'"),
])
def test_a_reward_target_that_does_not_resolve(tmp_path, tiny_actor_model, target, expected):
    (tmp_path / "myreward.py").write_text("def score(prompts, responses):\n    return [0.0] * len(responses)\n")
    config = tmp_path / "c.yaml"
    config.write_text(f'model: {{path: "{tiny_actor_model}"}}\nrewards:\n  - {{kind: function, target: "{target}"}}\n')
    err = _one_line_error(_train(tmp_path, config=config))
    assert f"rewards[0].target: " in err and expected in err


def test_a_broken_jsonl_line(tmp_path, tiny_actor_model):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "count a", "answer": "1"}\n{"prompt": \n')
    err = _one_line_error(_train(tmp_path, f"model.path={tiny_actor_model}", "data.source=jsonl",
                                 "data.path=bad.jsonl"))
    assert "bad.jsonl:2 is not valid JSON" in err and "fix or remove the line" in err


def test_a_missing_model_directory_without_a_preset(tmp_path):
    err = _one_line_error(_train(tmp_path, f"model.path={tmp_path / 'typo'}"))
    assert f"model.path '{tmp_path / 'typo'}' holds no model" in err and "model.preset=tiny" in err


def test_conversations_need_a_chat_template(tmp_path, tiny_actor_model):
    """The char tokenizer of the tiny preset has no chat template."""
    (tmp_path / "chat.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n')
    err = _one_line_error(_train(tmp_path, f"model.path={tiny_actor_model}", "data.source=jsonl",
                                 "data.path=chat.jsonl"))
    assert "has no chat template" in err


def test_a_model_directory_without_a_tokenizer(tmp_path, tiny_actor_model):
    model = tmp_path / "model"
    shutil.copytree(tiny_actor_model, model, ignore=shutil.ignore_patterns("tokenizer*"))
    err = _one_line_error(_train(tmp_path, f"model.path={model}"))
    assert f"model.path '{model}' holds no tokenizer" in err and "tokenizer.save_pretrained" in err


def test_an_override_that_is_not_yaml(tmp_path):
    err = _one_line_error(_train(tmp_path, "rewards=[{kind:"))
    assert "override 'rewards=[{kind:': its value is not valid YAML" in err


@pytest.mark.parametrize("overrides, expected", [
    (["data.task=calc"], "data.task 'calc' is played in episodes: set env.target=actors.envs:Calculator"),
    (["data.task=guess", "env.target=actors.envs:Guess"], "module actors.envs has no 'Guess'"),
    (["data.task=guess", "env.target=actors.tasks:score"], "is no environment class: it needs methods reset"),
    (["env.target=actors.envs:GuessNumber", "generator.engine=hf"], "generator.engine must be vllm with env.target"),
])
def test_an_environment_that_is_missing_or_does_not_fit(tmp_path, tiny_actor_model, overrides, expected):
    err = _one_line_error(_train(tmp_path, f"model.path={tiny_actor_model}", *overrides))
    assert expected in err


def _offline(tmp_path) -> dict:
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}


def test_a_hub_id_offline_and_not_cached(tmp_path):
    err = _one_line_error(_train(tmp_path, "model.path=Qwen/Qwen2.5-0.5B-Instruct", env=_offline(tmp_path)))
    assert "model.path 'Qwen/Qwen2.5-0.5B-Instruct' is no local directory" in err
    assert "`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct`" in err and "unset HF_HUB_OFFLINE" in err


def _moe(tmp_path, config) -> str:
    """A model directory holding only the config.json of a tiny mixture-of-experts model."""
    path = tmp_path / config.model_type
    config.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("config", [
    MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, num_local_experts=4, vocab_size=64),
    Qwen3MoeConfig(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, num_experts=4, vocab_size=64),
], ids=["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_model_is_refused_with_its_family(tmp_path, config):
    with pytest.raises(ConfigError) as raised:
        preflight(load_config(overrides=[f"model.path={_moe(tmp_path, config)}"]))
    message = str(raised.value)
    assert f"is a mixture-of-experts model (model_type {config.model_type})" in message
    assert "fused 3-D tensors" in message and "use a dense model" in message


def test_a_mixture_of_experts_hub_id_is_resolved_through_the_cache_and_refused(tmp_path):
    """The CLI's own process finds the id in HF_HOME's cache (offline) and reads its config."""
    model = _moe(tmp_path, MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    cache_hub_model(tmp_path / "hf", "mistralai/Mixtral-tiny", tmp_path / model)
    err = _one_line_error(_train(tmp_path, "model.path=mistralai/Mixtral-tiny", env=_offline(tmp_path)))
    assert "model.path 'mistralai/Mixtral-tiny' is a mixture-of-experts model (model_type mixtral)" in err


# Gemma's rule: no system turn (its template raises, as this one does).
NO_SYSTEM_ROLE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                  "{% endif %}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}<start_of_turn>model\n")


def test_a_template_that_rejects_the_system_role_with_a_system_prompt(tmp_path, tiny_actor_model):
    model = tmp_path / "gemma-like"
    shutil.copytree(tiny_actor_model, model)
    (model / "chat_template.jinja").write_text(NO_SYSTEM_ROLE)
    preflight(load_config(overrides=[f"model.path={model}", 'data.chat_template="on"']))  # no system turn: fine
    with pytest.raises(ConfigError) as raised:
        preflight(load_config(overrides=[f"model.path={model}", "data.system_prompt=Be brief."]))
    message = str(raised.value)
    assert "data.system_prompt is set, but the chat template of model.path" in message
    assert "System role not supported" in message and "leave data.system_prompt empty" in message
    assert "give data.chat_template a Jinja file that accepts one" in message and "\n" not in message
    accepting = tmp_path / "accepting.jinja"
    accepting.write_text(NO_SYSTEM_ROLE.split("{% endif %}")[1])
    preflight(load_config(overrides=[f"model.path={model}", "data.system_prompt=Be brief.",
                                     f"data.chat_template={accepting}"]))


def test_a_model_that_cannot_fit_this_machine_is_refused_with_its_estimate(tmp_path, tiny_actor_model):
    """Qwen2.5-7B's shape (its config.json; no weights are read) at the defaults: ~120 GiB of
    weights, gradients and AdamW states alone."""
    model = tmp_path / "qwen7b"
    shutil.copytree(tiny_actor_model, model)
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}))
    err = _one_line_error(_train(tmp_path, f"model.path={model}"))
    assert "placement: auto finds no setting that fits a 7.62B-parameter model here" in err
    assert "the smallest needs an estimated" in err and "GiB available" in err
    err = _one_line_error(_train(tmp_path, f"model.path={model}", "placement=manual"))
    assert "this job on a 7.62B-parameter model needs an estimated" in err
