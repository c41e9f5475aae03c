"""Rewards: a Python function, a local HF sequence-classification model, an HTTP endpoint, and
their weighted combination.

`Scorer.score` never raises for a bad reward: a reward that raises, times out, returns a value
that is not a finite number, or returns the wrong number of values marks the affected samples as
failed with a reason tag (reward_raised, reward_timeout, reward_nan, reward_bad_output), and the
generator sets those samples aside and counts them. When a batch call raises, each sample is
retried alone so that one bad response does not take its batch down with it. Calls run in worker
processes (actors/reward_pool.py): one past its deadline is killed with all it holds.
"""

from __future__ import annotations

import importlib
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from async_rlhf.config import RewardSpec
from async_rlhf.hub import resolve_model
from async_rlhf.protocols import RewardFn
from async_rlhf.types import Prompt, Sample

from actors.reward_pool import RewardPool


def load_function(target: str, what: str = "reward target", example: str = "module:function, e.g. "
                  "actors.tasks:score") -> Callable:
    """Import `module:function` (or `module:Class`: an environment, actors/episodes.py)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {target!r} must look like {example}")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise AttributeError(f"{what} {target!r}: module {module_name} has no {attr!r}")
    return getattr(module, attr)


class FunctionReward:
    """fn(prompts, responses) -> list[float], named `module:function`."""

    def __init__(self, target: str, name: str | None = None):
        self.fn = load_function(target)
        self.name = name or target

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        return list(self.fn(prompts, responses))


class ModelReward:
    """A local AutoModelForSequenceClassification; reward = logit 0 of prompt text + response.

    The model loads where the reward is called: a pickled copy (a RewardPool worker's) loads it
    as it is unpickled, while its worker starts, so that no call's deadline pays for it."""

    def __init__(self, path: str, name: str | None = None, batch_size: int = 16):
        self.path, self.batch_size = path, batch_size
        self.name = name or f"model:{path}"
        self.model = self.tokenizer = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name, "batch_size": self.batch_size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)
        self._load()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = resolve_model(self.path, "rewards[].target")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        import torch

        if self.model is None:
            self._load()
        texts = [p.text + r for p, r in zip(prompts, responses, strict=True)]
        scores: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True)
                scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores


class HttpReward:
    """POST {"prompts", "answers", "responses"} as JSON; expects {"rewards": [float, ...]}.

    Each attempt waits at most timeout_s; connection errors, 5xx answers and timeouts are retried
    `retries` times with a short backoff; the last error is raised. The scorer's deadline for
    the call (`deadline_s`) covers every attempt and backoff.
    """

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 2, name: str | None = None):
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.name = name or url

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        body = json.dumps(
            {"prompts": [p.text for p in prompts], "answers": [p.answer for p in prompts],
             "responses": list(responses)}
        ).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    return [float(r) for r in json.loads(reply.read())["rewards"]]
            except urllib.error.HTTPError as e:
                if e.code < 500 or attempt == self.retries:
                    raise
            except (urllib.error.URLError, TimeoutError, ConnectionError):
                if attempt == self.retries:
                    raise
            time.sleep(_backoff_s(attempt))
        raise AssertionError("unreachable")


def deadline_s(spec: RewardSpec) -> float:
    """The most one call of this reward may take: timeout_s, or for HTTP every attempt's
    timeout_s and the backoffs between them."""
    if spec.kind != "http":
        return spec.timeout_s
    return (spec.retries + 1) * spec.timeout_s + sum(_backoff_s(a) for a in range(spec.retries))


def _backoff_s(attempt: int) -> float:
    return min(0.1 * 2**attempt, 2.0)


def make_reward(spec: RewardSpec) -> RewardFn:
    if spec.kind == "function":
        return FunctionReward(spec.target)
    if spec.kind == "model":
        return ModelReward(spec.target)
    if spec.kind == "http":
        return HttpReward(spec.target, spec.timeout_s, spec.retries)
    raise ValueError(f"reward kind must be function, model or http, got {spec.kind!r}")


@dataclass(frozen=True)
class Scored:
    """One response's reward, or why it has none (failure = (reason, detail))."""

    reward: float = math.nan
    parts: dict[str, float] = field(default_factory=dict)
    failure: tuple[str, str] | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


class Scorer:
    """Weighted sum of rewards. Every reward call runs in a worker process of a RewardPool of
    `concurrency` processes and is bounded by its reward's deadline; `score` may be called from
    that many threads at once."""

    def __init__(self, rewards: Sequence[tuple[RewardFn, float, float]], concurrency: int = 1):
        """rewards: (reward, weight, deadline_s) triples."""
        if not rewards:
            raise ValueError("a scorer needs at least one reward")
        names = [r.name for r, _, _ in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be distinct, got {names}")
        self.rewards = list(rewards)
        self.pool = RewardPool([r for r, _, _ in rewards], concurrency)

    @classmethod
    def from_specs(cls, specs: Sequence[RewardSpec], concurrency: int = 1) -> Scorer:
        return cls([(make_reward(s), s.weight, deadline_s(s)) for s in specs], concurrency)

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[Scored]:
        parts: list[dict[str, float]] = [{} for _ in responses]
        failures: list[tuple[str, str] | None] = [None] * len(responses)
        for index, (reward, _, deadline) in enumerate(self.rewards):
            values = self._call(index, deadline, prompts, responses)
            for i, value in enumerate(values):
                if failures[i] is None:
                    if isinstance(value, tuple):
                        failures[i] = value
                    else:
                        parts[i][reward.name] = value
        weights = {r.name: w for r, w, _ in self.rewards}
        return [
            Scored(sum(weights[k] * v for k, v in p.items()), p) if f is None else Scored(failure=f)
            for p, f in zip(parts, failures)
        ]

    def score_samples(self, prompts: Sequence[Prompt], samples: Sequence[Sample]) -> list[Scored]:
        """The samples' rewards: their environment's where it failed or rewarded every one
        (episodes, actors/episodes.py), else this scorer's on their text (so samples scored
        together are never scored two ways)."""
        if any(s.failure for s in samples) or all(s.reward is not None for s in samples):
            return [Scored(failure=s.failure) if s.failure else Scored(s.reward, s.reward_parts or {"env": s.reward})
                    for s in samples]
        return self.score(prompts, [s.text for s in samples])

    def _call(self, index: int, deadline: float, prompts, responses) -> list:
        """One value per response: a finite float or a (reason, detail) failure."""
        name = self.rewards[index][0].name
        outcome = self.pool.call(index, prompts, responses, deadline)
        if isinstance(outcome, tuple) and outcome[0] == "reward_raised" and len(responses) > 1:
            # one call per response finds the culprit(s); the others keep their rewards
            return [self._call(index, deadline, [p], [r])[0] for p, r in zip(prompts, responses)]
        if isinstance(outcome, tuple):
            return [outcome] * len(responses)
        if len(outcome) != len(responses):
            bad = ("reward_bad_output",
                   f"{name} returned {len(outcome)} values for {len(responses)} responses")
            return [bad] * len(responses)
        return [self._check(name, v) for v in outcome]

    @staticmethod
    def _check(name: str, value) -> float | tuple[str, str]:
        try:
            value = float(value)
        except (TypeError, ValueError):
            return ("reward_bad_output", f"{name} returned {value!r}, not a number")
        if not math.isfinite(value):
            return ("reward_nan", f"{name} returned {value}")
        return value
