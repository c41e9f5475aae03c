"""`train`'s checks before anything starts: what a config names must be there and readable.

Before Ray, Redis or an engine starts, every reward target is resolved (a function imported, a
reward-model directory or a URL checked), the data source is read through (every JSONL line, a
data set's records, a held-out eval file), a Hub id is resolved through this node's Hugging Face
cache (async_rlhf.hub), and the model directory's config and tokenizer files are there, of a
family the job can train (no mixture of experts), with a chat template where the prompts need one
(and one that takes data.system_prompt). A problem raises ConfigError with the value and the fix;
the CLI prints it as one line and exits 2, within seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from async_rlhf.config import Config, ConfigError
from async_rlhf.hub import resolve_model


def preflight(cfg: Config) -> int:
    """Raise ConfigError for the first thing `cfg` names that is missing or unreadable. Returns
    the longest prompt's characters (the system prompt's included): a bound on its tokens for
    the memory estimate (launch/memory.py)."""
    from actors.prompts import load_records, read_jsonl
    from actors.tasks import get_task

    for i, spec in enumerate(cfg.rewards):
        _check_reward(i, spec.kind, spec.target)
    if cfg.env.target:
        load_environment(cfg.env.target)
    if cfg.env.agent:
        load_agent(cfg.env.agent)
    try:
        if cfg.data.source == "preferences":  # records without a prompt are dead-lettered later
            key = cfg.data.prompt_key
            records = [(row[key], "") for row in read_jsonl(cfg.data.path) if key in row]
        else:
            records = load_records(cfg.data, seed=cfg.seed)
        if isinstance(cfg.eval.prompts, str):
            read_jsonl(cfg.eval.prompts)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ConfigError(_one_line(e)) from None
    if not cfg.env.target and not cfg.env.agent and cfg.data.source == "task" and (env := get_task(cfg.data.task).env):
        raise ConfigError(f"data.task {cfg.data.task!r} is played in episodes: set env.target={env} "
                          "(configs/agent.yaml shows one)")
    _check_model(cfg, records)
    if cfg.log.wandb.project and importlib.util.find_spec("wandb") is None:
        from async_rlhf.launch.trackers import wandb_missing

        raise ConfigError(wandb_missing())
    chars = [len(p) if isinstance(p, str) else sum(len(str(m.get("content", ""))) for m in p) for p, _ in records]
    return max(chars, default=0) + len(cfg.data.system_prompt)


def load_environment(target: str) -> type:
    """The environment class env.target names; ConfigError when it is not there or lacks
    reset and step."""
    from actors.rewards import load_function

    _importable_here()
    try:
        cls = load_function(target, "env.target", "module:Class, e.g. actors.envs:GuessNumber")
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{_one_line(e)} (a class importable from where `train` runs)") from None
    if not (isinstance(cls, type) and callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ConfigError(f"env.target {target!r} is no environment class: it needs methods reset(prompt) "
                          "and step(response) (see actors/envs.py)")
    return cls


def load_agent(target: str):
    """The agent function env.agent names; ConfigError when it is not there or not `async def`."""
    import inspect

    from actors.rewards import load_function

    _importable_here()
    try:
        fn = load_function(target, "env.agent", "module:function, e.g. actors.envs:calculator_agent")
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{_one_line(e)} (a function importable from where `train` runs)") from None
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"env.agent {target!r} is no agent: it must be `async def agent(client, prompt)` "
                          "(see actors/envs.py: calculator_agent)")
    return fn


def _importable_here() -> None:
    if os.getcwd() not in sys.path:  # the job's actors import from the driver's directory (Ray)
        sys.path.insert(0, os.getcwd())


def _check_reward(i: int, kind: str, target: str) -> None:
    from actors.rewards import load_function

    key = f"rewards[{i}].target"
    if kind == "function":
        _importable_here()
        try:
            load_function(target)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"{key}: {_one_line(e)} (a module:function importable from where "
                              "`train` runs, e.g. actors.tasks:score)") from None
    elif kind == "model" and not (Path(resolve_model(target, key)) / "config.json").is_file():
        raise ConfigError(f"{key} {target!r} is no reward-model directory (no config.json): "
                          "point it at a saved AutoModelForSequenceClassification or its Hub id")
    elif kind == "http" and not target.startswith(("http://", "https://")):
        raise ConfigError(f"{key} {target!r} must be an http:// or https:// URL")


# What transformers' AutoTokenizer loads a tokenizer from, and a chat template from (besides
# tokenizer_config.json's "chat_template"): transformers.utils.hub
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _check_model(cfg: Config, records: list) -> None:
    """The model (a directory, or a Hub id resolved through this node's cache) holds a model
    config of a family the job can train and a tokenizer (unless a preset is to build it), with
    a chat template where prompts are rendered as chats. Files are read, not loaded: importing
    transformers alone takes seconds, and the parts that load the model say what fails."""
    name = cfg.model.path
    if not (Path(name) / "config.json").is_file() and cfg.model.preset is not None:
        return  # the launcher builds a random-init model there
    path = Path(resolve_model(name))
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.path {name!r} holds no model (no config.json): point it at a Hugging Face model "
            "directory or Hub id, or set model.preset=tiny (or small) to build a random-init one there")
    try:
        config = json.loads((path / "config.json").read_text())
        tokenizer_config = path / "tokenizer_config.json"
        tokenizer_config = json.loads(tokenizer_config.read_text()) if tokenizer_config.is_file() else {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path {name!r} does not load: {_one_line(e)}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"model.path {name!r}: its config.json names no model_type; save the model "
                          "with model.save_pretrained(...)")
    _check_family(name, config)
    if not any((path / n).is_file() for n in _TOKENIZER_FILES):
        raise ConfigError(f"model.path {name!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): "
                          "save one there with tokenizer.save_pretrained(...)")
    template = cfg.data.chat_template
    has_conversations = any(isinstance(prompt, list) for prompt, _ in records)
    needs_template = template == "on" or (template == "auto" and has_conversations)
    has_template = bool(tokenizer_config.get("chat_template")) or any(
        (path / n).is_file() for n in _CHAT_TEMPLATE_FILES)
    if needs_template and not has_template:
        raise ConfigError(f"data.chat_template={template}: the tokenizer at {name!r} has no chat "
                          "template; give a Jinja file as data.chat_template, or use plain-string prompts")
    if records and cfg.data.system_prompt and (has_template or template not in ("auto", "on")):
        _check_system_role(cfg, path, records[0][0])


def _check_family(name: str, config: dict) -> None:
    """Refuse a mixture-of-experts model (its config, or its text config, counts experts, or
    its model_type ends in _moe): transformers 5 keeps its experts as fused 3-D tensors whose
    names neither the checkpoint nor vLLM uses, so weight updates cannot be mapped to vLLM."""
    parts = [part for part in (config, config.get("text_config")) if isinstance(part, dict)]
    if any(part.get("num_experts") or part.get("num_local_experts")
           or str(part.get("model_type", "")).endswith("_moe") for part in parts):
        raise ConfigError(
            f"model.path {name!r} is a mixture-of-experts model (model_type {config['model_type']}), which "
            "cannot be trained here yet: transformers 5 holds its experts as fused 3-D tensors whose names "
            "neither the checkpoint nor vLLM uses, so the learner's weight updates cannot be mapped onto "
            "the generators; use a dense model (Qwen2.5/Qwen3 dense, Llama 3, Gemma, Mistral, Phi, GPT-2)")


def _check_system_role(cfg: Config, path: Path, prompt) -> None:
    """Render the first prompt with data.system_prompt as the generators will: a template that
    rejects the system role (Gemma's raises "System role not supported") fails here."""
    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    from actors.prompts import ChatRenderer

    render = ChatRenderer.from_config(AutoTokenizer.from_pretrained(path), cfg.data)
    try:
        render(prompt, "the first prompt")
    except TemplateError as e:
        template = cfg.data.chat_template if Path(cfg.data.chat_template).is_file() else f"model.path {cfg.model.path!r}'s"
        raise ConfigError(
            f"data.system_prompt is set, but the chat template of {template} rejects a system message "
            f"({_one_line(e)}): leave data.system_prompt empty, or give data.chat_template a Jinja file "
            "that accepts one") from None


def _one_line(e: BaseException) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(text.split())
