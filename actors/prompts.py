"""Prompt sources: a built-in task, a JSONL file, or a local data set directory.

Every source becomes a fixed list of (text, answer) records, tokenized with the model's tokenizer
(which prepends <bos>) and served endlessly: each epoch visits every record once, in an order
shuffled deterministically from (seed, epoch), so two runs with the same seed see the same prompts.

`data.source: hf_dataset` reads a directory, in this order of preference:
  - a `datasets` save_to_disk() directory (it has dataset_info.json, state.json or
    dataset_dict.json; a DatasetDict contributes its "train" split); needs `pip install datasets`;
  - otherwise every *.jsonl file in it (sorted by name), one JSON object per line.
Records need `data.prompt_key`; `data.answer_key` is optional ("" when absent).

A record's prompt is a string or a conversation: a list of {"role", "content"} messages, e.g.

    {"prompt": [{"role": "system", "content": "Answer with digits."},
                {"role": "user", "content": "copy 3142="}], "answer": "3142"}

Conversations are rendered with the tokenizer's chat template (or `data.chat_template`'s Jinja
file) and add_generation_prompt, as TRL does; `data.system_prompt` puts a system message first;
`data.chat_template: on` renders plain strings too, as one user message. The rendered text and
its token ids (tokenized without adding special tokens: the template writes them) are what the
model sees, the trajectory carries and the learner trains on; rewards also get the messages.

Prompts longer than `max_tokens` (the generator passes the model's context minus
generator.max_new_tokens), or than generator.max_prompt_tokens where that is set and lower, are
skipped with a warning that says how many and the fix; when none is left, that is an error. The
records themselves stay where they are.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from async_rlhf.config import DataConfig
from async_rlhf.types import Prompt

log = logging.getLogger(__name__)

TASK_POOL_SIZE = 4096  # records generated for a built-in task (an epoch of the task source)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} not found (data.path)")
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{line_no} is not valid JSON ({e.msg}): fix or remove the line"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_no} must hold a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def read_dataset_dir(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"data set directory {str(path)!r} not found (data.path)")
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if any((path / m).is_file() for m in markers):
        try:
            import datasets
        except ImportError as e:
            raise ImportError(
                f"{path} was written by datasets' save_to_disk: `pip install datasets` to read it, "
                "or export it to *.jsonl files in a directory"
            ) from e
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise ValueError(f"{path} has splits {list(data)}, none called 'train'")
            data = data["train"]
        return [dict(row) for row in data]
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.jsonl files and is not a save_to_disk() directory")
    return [row for f in files for row in read_jsonl(f)]


Record = tuple[str | list[dict[str, str]], str]  # (prompt text or conversation, answer)


def load_records(data: DataConfig, seed: int = 0) -> list[Record]:
    """The (prompt, answer) records `data` names."""
    if data.source == "task":
        from actors.tasks import examples

        return examples(data.task, seed, TASK_POOL_SIZE)
    rows = read_jsonl(data.path) if data.source == "jsonl" else read_dataset_dir(data.path)
    if not rows:
        raise ValueError(f"{data.path} holds no records")
    records = []
    for i, row in enumerate(rows):
        if data.prompt_key not in row:
            raise KeyError(
                f"record {i} of {data.path} has no {data.prompt_key!r} field (data.prompt_key); "
                f"its fields: {', '.join(map(str, row))}"
            )
        prompt = row[data.prompt_key]
        if isinstance(prompt, list):
            _check_messages(prompt, f"record {i} of {data.path}")
        records.append((prompt if isinstance(prompt, list) else str(prompt),
                        str(row.get(data.answer_key, ""))))
    return records


def _check_messages(messages: list, where: str) -> None:
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {j} must be a {{'role': str, 'content': str}} map, "
                             f"got {m!r}")


class ChatRenderer:
    """A record's prompt -> (text, token ids, messages) as the model sees it (see the module
    docstring). `chat_template`: auto, on, off or a Jinja file's path (data.chat_template);
    `template_kwargs`: the template's extra variables (data.chat_template_kwargs)."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str = "",
                 template_kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.mode, self.system_prompt = tokenizer, chat_template, system_prompt
        self.template_kwargs = template_kwargs or {}
        self.template = (tokenizer.chat_template if chat_template in ("auto", "on", "off")
                         else Path(chat_template).read_text())

    @classmethod
    def from_config(cls, tokenizer, data: DataConfig) -> ChatRenderer:
        return cls(tokenizer, data.chat_template, data.system_prompt, data.chat_template_kwargs)

    def __call__(self, prompt: str | list[dict[str, str]], where: str):
        conversation = isinstance(prompt, list)
        if self.mode == "off" or not (conversation or self.system_prompt or self.mode != "auto"):
            if conversation:
                raise ValueError(f"{where} is a conversation but data.chat_template=off: set it to "
                                 "auto (the tokenizer's template) or a Jinja file")
            return prompt, tuple(self.tokenizer(prompt)["input_ids"]), ()
        messages = list(prompt) if conversation else [{"role": "user", "content": prompt}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if not self.template:
            raise ValueError(f"{where} is to be rendered as a chat, but the tokenizer has no chat "
                             "template: set data.chat_template=<a Jinja file>")
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=True,
                                                  **self.template_kwargs)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text, tuple(ids), tuple(messages)


class PromptStream:
    """Endless, deterministically shuffled prompts over a fixed record list."""

    def __init__(
        self, records: Sequence[Record], tokenizer, *, seed: int = 0, stream: int = 0,
        name: str = "prompts", max_tokens: int | None = None, max_prompt_tokens: int = 0,
        render: ChatRenderer | None = None,
    ):
        """`stream` varies the order only (give each generator its own), `seed` the order too;
        prompts over `max_tokens` tokens (the model's context minus the response limit) or over
        `max_prompt_tokens` (generator.max_prompt_tokens; 0: none) are skipped (see the module
        docstring); `render` turns a record's prompt into what the model sees (default: the
        tokenizer's, auto)."""
        if not records:
            raise ValueError("a prompt stream needs at least one record")
        render = render or ChatRenderer(tokenizer)
        prompts = []
        for i, (prompt, answer) in enumerate(records):
            text, ids, messages = render(prompt, f"prompt {name}:{i}")
            prompts.append(Prompt(f"{name}:{i}", ids, text, answer, messages))
        limit, why, fix = _prompt_limit(max_tokens, max_prompt_tokens)
        self.prompts = [p for p in prompts if limit is None or len(p.token_ids) <= limit]
        if len(self.prompts) < len(prompts):
            longest = max(len(p.token_ids) for p in prompts)
            msg = (f"{len(prompts) - len(self.prompts)} of {len(prompts)} prompts of {name} are longer "
                   f"than {limit} tokens ({why}; the longest has {longest})")
            if not self.prompts:
                raise ValueError(f"{msg}: none is left; shorten the prompts or {fix}")
            log.warning("%s: skipped; shorten them or %s to use them", msg, fix)
        self.seed = seed
        self.stream = stream
        self.epoch = 0
        self._order: list[int] = []
        self._next = 0

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        if self._next >= len(self._order):
            if self._order:
                self.epoch += 1
            self._shuffle()
        self._next += 1
        return self.prompts[self._order[self._next - 1]]

    def _shuffle(self) -> None:
        self._order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}/{self.stream}/{self.epoch}").shuffle(self._order)
        self._next = 0

    @property
    def position(self) -> int:
        """Prompts taken so far, over all epochs: what `seek` continues from."""
        return self.epoch * len(self.prompts) + self._next

    def seek(self, position: int) -> None:
        """Continue as if `position` prompts had been taken (a resumed job's generators)."""
        if position < 0:
            raise ValueError(f"a prompt stream position must be >= 0, got {position}")
        self.epoch, next_index = divmod(position, len(self.prompts))
        self._shuffle()
        self._next = next_index

    def take(self, count: int) -> list[Prompt]:
        return [next(self) for _ in range(count)]


def _prompt_limit(max_tokens: int | None, max_prompt_tokens: int) -> tuple[int | None, str, str]:
    """The most tokens a prompt may have (None: no limit), what sets it, and the setting that
    lifts it (PromptStream's arguments)."""
    if max_prompt_tokens and (max_tokens is None or max_prompt_tokens < max_tokens):
        return max_prompt_tokens, "generator.max_prompt_tokens", "raise generator.max_prompt_tokens"
    return max_tokens, "the model's context minus generator.max_new_tokens", "lower generator.max_new_tokens"


def make_prompt_stream(data: DataConfig, tokenizer, seed: int = 0, stream: int = 0,
                       max_tokens: int | None = None, max_prompt_tokens: int = 0) -> PromptStream:
    """The prompts `data` names; generators share `seed` (same records) and differ in `stream`."""
    name = data.task if data.source == "task" else Path(data.path).stem
    return PromptStream(load_records(data, seed), tokenizer, seed=seed, stream=stream, name=name,
                        max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                        render=ChatRenderer.from_config(tokenizer, data))
