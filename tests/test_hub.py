"""Models named by Hugging Face Hub id resolve through this node's cache (async_rlhf/hub.py), offline
here, against a cache laid out as huggingface_hub leaves it; a context length nested in a text config
is found."""

import pytest
from huggingface_hub import constants
from transformers import AutoConfig, AutoTokenizer, Gemma3Config, GPT2Config, LlamaConfig

from actors.model_init import ensure_model
from async_rlhf.config import ConfigError, LearnerConfig
from async_rlhf.hub import context_length, is_hub_id, resolve_model
from helpers import cache_hub_model
from learners.backends import make_backend

HUB_ID = "tiny-org/tiny-chat"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HOME at an empty tmp cache with HF_HUB_OFFLINE set, for this process (huggingface_hub
    reads both at import) and for any it starts."""
    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home


def test_a_hub_id_resolves_to_its_cached_snapshot_and_a_directory_stays(offline_cache, tiny_actor_model, tmp_path):
    snapshot = cache_hub_model(offline_cache, HUB_ID, tiny_actor_model)
    assert resolve_model(HUB_ID) == str(snapshot)
    assert AutoTokenizer.from_pretrained(resolve_model(HUB_ID))("copy 1=")["input_ids"][0] == 1
    assert resolve_model(str(tiny_actor_model)) == str(tiny_actor_model)
    assert ensure_model(HUB_ID, preset=None) == snapshot  # the launcher's check, no model built
    backend = make_backend(LearnerConfig(backend="torch"), HUB_ID, dtype="float32", temperature=1.0, seed=0)
    assert backend is not None  # the learner loads the cached snapshot by its id


def test_what_reads_as_a_hub_id(tmp_path, tiny_actor_model):
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")
    assert not is_hub_id(str(tiny_actor_model))  # an existing directory
    assert not is_hub_id(str(tmp_path / "missing"))  # an absolute path
    assert not is_hub_id("runs/models/tiny")  # more than org/name


def test_an_uncached_hub_id_offline_names_the_id_and_the_fix(offline_cache):
    with pytest.raises(ConfigError) as raised:
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(raised.value)
    assert "model.path 'Qwen/Qwen2.5-0.5B-Instruct'" in message and "HF_HUB_OFFLINE is set" in message
    assert "`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct`" in message
    assert "set HF_HOME to a cache that holds it" in message and "\n" not in message
    with pytest.raises(ConfigError, match="rewards\\[0\\].target 'org/rm'"):
        resolve_model("org/rm", "rewards[0].target")


def test_context_length_is_read_from_a_nested_text_config():
    nested = Gemma3Config(text_config={"max_position_embeddings": 4096})
    assert not hasattr(nested, "max_position_embeddings")  # multimodal: only its text config has it
    assert context_length(nested) == 4096
    assert context_length(LlamaConfig(max_position_embeddings=512)) == 512
    assert context_length(GPT2Config(n_positions=1024)) == 1024


def test_context_length_of_a_saved_nested_config(tmp_path):
    Gemma3Config(text_config={"max_position_embeddings": 2048}).save_pretrained(tmp_path)
    assert context_length(AutoConfig.from_pretrained(tmp_path)) == 2048


def test_a_generator_resolves_a_hub_id_and_applies_max_prompt_tokens(offline_cache, tiny_actor_model):
    from actors.generator import make_generator
    from async_rlhf.config import load_config
    from async_rlhf.staleness import StalenessGate

    cache_hub_model(offline_cache, HUB_ID, tiny_actor_model)
    cfg = load_config(overrides=[f"model.path={HUB_ID}", "generator.engine=hf", "generator.max_prompt_tokens=5",
                                   "generator.max_new_tokens=16"])
    with pytest.raises(ValueError, match=r"longer than 5 tokens \(generator.max_prompt_tokens"):
        make_generator(cfg, queue=None, gate=StalenessGate(max_staleness=1, batch_size=4))
