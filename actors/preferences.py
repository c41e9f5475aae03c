"""Offline preference pairs into the experience stream, in place of a generator (data.source:
preferences, with learner.algorithm: dpo).

data.path is a JSONL file of {"prompt": ..., "chosen": "...", "rejected": "..."} records (the
prompt under data.prompt_key, a string or a conversation, rendered as generators render theirs:
actors/prompts.py). Each record becomes one group of two trajectories of its prompt: the chosen
response with reward 1, the rejected with reward 0, which the learner's dpo takes as a pair.
Responses are tokenized without special tokens, then end with the tokenizer's EOS, as a finished
generation does. Behaviour log-probs are zeros: no policy sampled these responses, and DPO does
not read them.

The pairs pass the same staleness gate as generated groups, stamped with the newest policy
version this producer has heard of (it follows the weight broadcasts for their version only),
so the stream holds at most max_staleness + 1 batches ahead of the learner and none is dropped
as stale. It is a weight-sync member of no rank: each update's RPC brings it the version and none
of the bytes. The file is served in order, epoch after epoch (learner.steps sets how long); the
position of the last put is recorded in the stream, so a restarted producer or a resumed job goes
on from there. A record that cannot be a pair is dead-lettered in the first epoch, with its reason
(missing_field, not_text, empty_response, identical_responses, too_long) and line number, and skipped after.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np

from async_rlhf.config import Config
from async_rlhf.hub import context_length, resolve_model
from async_rlhf.messages import GeneratorStats, SyncAddress
from async_rlhf.protocols import AdmissionGate, ExperienceQueue
from async_rlhf.types import Group, Trajectory
from async_rlhf.weight_sync import UpdateMeta

log = logging.getLogger(__name__)

FIELDS = ("chosen", "rejected")  # the response keys of a record (the prompt's is data.prompt_key)


def check_record(row: dict, prompt_key: str) -> tuple[str, str] | None:
    """(reason, detail) if the record cannot be a pair, else None."""
    missing = [k for k in (prompt_key, *FIELDS) if k not in row]
    if missing:
        return "missing_field", f"no {missing[0]!r} (its fields: {', '.join(map(str, row))})"
    not_text = [k for k in FIELDS if not isinstance(row[k], str)]
    if not_text:
        return "not_text", f"{not_text[0]!r} is {type(row[not_text[0]]).__name__}, not a string"
    empty = [k for k in FIELDS if not row[k].strip()]
    if empty:
        return "empty_response", f"{empty[0]!r} is empty"
    if row["chosen"] == row["rejected"]:
        return "identical_responses", "chosen and rejected are the same text: no preference"
    return None


class VersionOnly:
    """The producer's side of the weight sync (a GenerationEngine's weight-sync part): it takes
    no rank in the group, since it needs no weights, only each update's version."""

    sync_ranks = 0
    policy_version = 0

    def join_weight_sync(self, address: SyncAddress, rank: int, host: str) -> None:
        """Nothing to join: the learner's RPC reaches it all the same."""

    def receive_weights(self, meta: UpdateMeta, load: bool, keep: Iterable[int] = ()) -> int:
        self.policy_version = meta.version
        return 0

    def load_staged(self, version: int) -> None:
        self.policy_version = version


class PreferenceProducer:
    """The generator role for offline pairs: run(stop), apply_weights (the version only, from
    `engine`), policy_version and stats(), as GeneratorWorker drives a Generator."""

    def __init__(self, rows: list[dict], render, tokenizer, queue: ExperienceQueue, gate: AdmissionGate, *,
                 prompt_key: str = "prompt", generator_id: str = "gen-0", max_tokens: int | None = None,
                 poll_s: float = 0.05):
        """rows: the file's records in order; render: actors.prompts.ChatRenderer; max_tokens:
        the model's context (a longer prompt + response is set aside as too_long)."""
        self.queue, self.gate, self.generator_id, self.poll_s = queue, gate, generator_id, poll_s
        self.max_tokens = max_tokens
        self.rows, self.render, self.tokenizer, self.prompt_key = rows, render, tokenizer, prompt_key
        self.bad = {i: why for i, row in enumerate(rows) if (why := check_record(row, prompt_key))}
        if len(self.bad) == len(rows):
            raise ValueError(f"none of the {len(rows)} preference records can be a pair (first: record "
                             f"{min(self.bad)}: {self.bad[min(self.bad)]}): fix data.path")
        self.engine = VersionOnly()
        self.prompt_start = self._taken = queue.prompt_positions().get(generator_id, 0)
        self._counts: Counter[str] = Counter()
        self._seconds: Counter[str] = Counter()
        self._set_aside: Counter[str] = Counter()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def apply_weights(self, load: Callable[[], object]) -> None:
        """Run `load`, which sets the learner's new version: later pairs are stamped with it."""
        load()
        self._counts["weight_updates"] += 1

    def run(self, stop: threading.Event) -> None:
        """Put one pair per admitted group until `stop`, from the recorded position on."""
        start = time.perf_counter()
        while not stop.is_set():
            index = self._taken % len(self.rows)
            if index in self.bad:
                if self._taken < len(self.rows):  # first epoch: once per record
                    self._dead_letter(index, *self.bad[index])
                self._taken += 1
                continue
            if not self.gate.try_admit(2):
                stop.wait(self.poll_s)
                continue
            group = self._pair(index)
            if isinstance(group, tuple):  # too long: a bad record, dead-lettered next time round
                self.bad[index] = group
                self.gate.finish(2, 0)
                continue
            self._taken += 1
            t = time.perf_counter()
            self.queue.put([group], prompt_position=self._taken)
            self._seconds["put"] += time.perf_counter() - t
            self.gate.finish(2, 2)
            self._counts.update(produced=2, groups=1, tokens=sum(len(m.response_ids) for m in group.members))
        self._seconds["run"] = time.perf_counter() - start

    def _pair(self, index: int) -> Group | tuple[str, str]:
        """Record `index` as a group (chosen, rejected), or (reason, detail) if it is too long."""
        row = self.rows[index]
        _, prompt_ids, _ = self.render(row[self.prompt_key], f"record {index} of the preference file")
        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        members = []
        for key, reward in (("chosen", 1.0), ("rejected", 0.0)):
            ids = np.asarray(self.tokenizer(row[key], add_special_tokens=False)["input_ids"] + eos, np.int32)
            members.append(Trajectory(
                prompt_ids=np.asarray(prompt_ids, np.int32), response_ids=ids,
                behavior_logprobs=np.zeros(len(ids), np.float32), reward=reward, reward_parts={key: reward},
                policy_version=self.policy_version, generator_id=self.generator_id,
                group_id=f"pref-{self._taken}", finished=True))
        longest = max(m.num_tokens for m in members)
        if self.max_tokens is not None and longest > self.max_tokens:
            return "too_long", f"{longest} tokens with the prompt, over the model's context of {self.max_tokens}"
        return Group(tuple(members))

    def _dead_letter(self, index: int, reason: str, detail: str) -> None:
        self._set_aside[reason] += 1
        log.warning("%s: preference record %d set aside (%s): %s", self.generator_id, index, reason, detail)
        payload = json.dumps({"generator_id": self.generator_id, "record": index,
                              "row": self.rows[index]}, default=str).encode()
        self.queue.dead_letter(reason, f"record {index}: {detail}", payload)

    def stats(self) -> GeneratorStats:
        return GeneratorStats(
            generator_id=self.generator_id, policy_version=self.policy_version, schedule="offline",
            update_mode="version_only", prompt_start=self.prompt_start, prompt_position=self._taken,
            produced=self._counts["produced"], groups=self._counts["groups"], tokens=self._counts["tokens"],
            steps=0, sequences=0, updates_waiting=0, aborted=0, set_aside=dict(self._set_aside),
            set_aside_total=sum(self._set_aside.values()),
            dropped_uniform=0,
            dead_letter_errors=0, weight_updates=self._counts["weight_updates"], inflight_updates=0,
            run_s=self._seconds["run"], generate_s=0.0, score_s=0.0, put_s=self._seconds["put"], idle_s=0.0,
            weight_update_s=0.0, weight_wait_s=0.0, mean_inflight=0.0, tokens_per_s=0.0,
            last_mean_reward=0.5 if self._counts["groups"] else float("nan"))


def make_preference_producer(cfg: Config, queue: ExperienceQueue, gate: AdmissionGate, *,
                             index: int = 0) -> PreferenceProducer:
    """The producer of data.path's pairs for generator slot `index` (the model directory must
    exist: its tokenizer tokenizes the records)."""
    from transformers import AutoConfig, AutoTokenizer

    from actors.prompts import ChatRenderer, read_jsonl

    path = resolve_model(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    render = ChatRenderer.from_config(tokenizer, cfg.data)
    context = context_length(AutoConfig.from_pretrained(path))
    return PreferenceProducer(read_jsonl(cfg.data.path), render, tokenizer, queue, gate,
                              prompt_key=cfg.data.prompt_key, generator_id=f"gen-{index}", max_tokens=context)
