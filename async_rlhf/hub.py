"""Where a model the config names lives on this node, and how long a context its config gives.

`model.path` and a reward model's `rewards[i].target` are a local directory or a Hugging Face Hub
id (`Qwen/Qwen2.5-0.5B-Instruct`). Every process that loads the model resolves the id itself,
through its own Hugging Face cache (HF_HOME; point every node at one shared cache to download
once): `snapshot_download` returns the cached snapshot, downloading it first where the network
and HF_HUB_OFFLINE allow. A name that is an existing path, or no Hub id at all (an absolute path,
one with more than one `/`), is used as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_rlhf.config import ConfigError

# Weights for other frameworks and originals that transformers and vLLM do not read.
_UNUSED_FILES = ["*.h5", "*.msgpack", "*.ot", "*.tflite", "*.gguf", "onnx/*", "original/*"]


def is_hub_id(name: str) -> bool:
    """`name` reads as a Hub id (`repo` or `org/repo`) and is no existing local path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(name: str, key: str = "model.path") -> str:
    """The local directory that holds model `name` (config key `key`): `name` itself, or the
    snapshot of Hub id `name` in this node's Hugging Face cache (see the module docstring)."""
    if not is_hub_id(name):
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(name, ignore_patterns=_UNUSED_FILES)
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"{key} {name!r} is no local directory, and the Hugging Face Hub model of that id is not in "
            f"the cache at {constants.HF_HUB_CACHE} and cannot be downloaded here{offline}: download it "
            f"with `huggingface-cli download {name}` on a networked machine with the same HF_HOME, set "
            "HF_HOME to a cache that holds it, or unset HF_HUB_OFFLINE where the Hub is reachable") from None
    except HfHubHTTPError as e:  # not found, gated, unauthorised
        reason = " ".join(str(e).split())
        raise ConfigError(f"{key} {name!r}: the Hugging Face Hub refused it ({reason}); check the id, "
                          "or log in with `huggingface-cli login` for a gated model") from None


def context_length(config: Any) -> int | None:
    """The most tokens model config `config` attends over (max_position_embeddings; GPT-2's
    n_positions), read from its text config where the family nests it there (Gemma 3 and other
    multimodal configs keep it in config.text_config); None where it names none."""
    for part in (config, getattr(config, "text_config", None)):
        tokens = getattr(part, "max_position_embeddings", None) or getattr(part, "n_positions", None)
        if tokens:
            return tokens
    return None
