"""`train` checks what its config names before anything starts: a reward target that does not
resolve, a JSONL with a broken line, a model directory that is not there (and no preset asked
for) or has no tokenizer, a chat without a template. Each ends the command with exit 2 and one
line naming the value and the fix, before Ray, Redis or an engine starts (OUT is never created)."""

import os
import shutil
import subprocess
import sys

import pytest


def _train(tmp_path, *overrides, config=None):
    cmd = [sys.executable, "-m", "async_rlhf.launch.cli", "train", "--out", str(tmp_path / "out")]
    if config:
        cmd += ["--config", str(config)]
    env = {**os.environ, "ASYNC_RLHF_HOME": str(tmp_path / "home")}
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
