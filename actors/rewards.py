"""Rewards: a Python function, a local HF sequence-classification model, an HTTP endpoint, and
their weighted combination.

`Scorer.score` never raises for a bad reward: a reward that raises, times out, returns a value
that is not a finite number, or returns the wrong number of values marks the affected samples as
failed with a reason tag (reward_raised, reward_timeout, reward_nan, reward_bad_output), and the
generator sets those samples aside and counts them. When a batch call raises, each sample is
retried alone so that one bad response does not take its batch down with it.
"""

from __future__ import annotations

import importlib
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from async_rlhf.config import RewardSpec
from async_rlhf.protocols import RewardFn
from async_rlhf.types import Prompt


def load_function(target: str) -> Callable:
    """Import `module:function`."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward target {target!r} must look like module:function, e.g. actors.tasks:score")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise AttributeError(f"reward target {target!r}: module {module_name} has no {attr!r}")
    return getattr(module, attr)


class FunctionReward:
    """fn(prompts, responses) -> list[float], named `module:function`."""

    def __init__(self, target: str, name: str | None = None):
        self.fn = load_function(target)
        self.name = name or target

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        return list(self.fn(prompts, responses))


class ModelReward:
    """A local AutoModelForSequenceClassification; reward = logit 0 of prompt text + response."""

    def __init__(self, path: str, name: str | None = None, batch_size: int = 16):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.name = name or f"model:{path}"
        self.batch_size = batch_size

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        texts = [p.text + r for p, r in zip(prompts, responses, strict=True)]
        scores: list[float] = []
        with self.torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True)
                scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores


class HttpReward:
    """POST {"prompts", "answers", "responses"} as JSON; expects {"rewards": [float, ...]}.

    Each attempt waits at most timeout_s; connection errors, 5xx answers and timeouts are retried
    `retries` times with a short backoff; the last error is raised.
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
            time.sleep(min(0.1 * 2**attempt, 2.0))
        raise AssertionError("unreachable")


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
    """Weighted sum of rewards; every reward call is bounded by its timeout."""

    def __init__(self, rewards: Sequence[tuple[RewardFn, float, float]]):
        """rewards: (reward, weight, timeout_s) triples."""
        if not rewards:
            raise ValueError("a scorer needs at least one reward")
        names = [r.name for r, _, _ in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be distinct, got {names}")
        self.rewards = list(rewards)

    @classmethod
    def from_specs(cls, specs: Sequence[RewardSpec]) -> Scorer:
        return cls([(make_reward(s), s.weight, s.timeout_s) for s in specs])

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[Scored]:
        parts: list[dict[str, float]] = [{} for _ in responses]
        failures: list[tuple[str, str] | None] = [None] * len(responses)
        for reward, _, timeout_s in self.rewards:
            values = self._call(reward, timeout_s, prompts, responses)
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

    def _call(self, reward: RewardFn, timeout_s: float, prompts, responses) -> list:
        """One value per response: a finite float or a (reason, detail) failure."""
        outcome = self._bounded(reward, timeout_s, prompts, responses)
        if isinstance(outcome, tuple) and outcome[0] == "reward_raised" and len(responses) > 1:
            # one call per response finds the culprit(s); the others keep their rewards
            return [self._call(reward, timeout_s, [p], [r])[0] for p, r in zip(prompts, responses)]
        if isinstance(outcome, tuple):
            return [outcome] * len(responses)
        if len(outcome) != len(responses):
            bad = ("reward_bad_output",
                   f"{reward.name} returned {len(outcome)} values for {len(responses)} responses")
            return [bad] * len(responses)
        return [self._check(reward.name, v) for v in outcome]

    @staticmethod
    def _bounded(reward: RewardFn, timeout_s: float, prompts, responses):
        """reward(prompts, responses) as a list, or a (reason, detail) failure. The call runs in
        a daemon thread: one that hangs past its timeout is abandoned (it cannot be killed) but
        neither blocks scoring nor keeps the process from exiting."""
        outcome: list = [("reward_timeout", f"{reward.name} took longer than {timeout_s} s")]

        def call() -> None:
            try:
                outcome[0] = list(reward(list(prompts), list(responses)))
            except Exception as e:  # noqa: BLE001 - any reward bug is the sample's failure
                outcome[0] = ("reward_raised", f"{reward.name}: {type(e).__name__}: {e}")

        thread = threading.Thread(target=call, name=f"reward:{reward.name}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        return outcome[0]

    @staticmethod
    def _check(name: str, value) -> float | tuple[str, str]:
        try:
            value = float(value)
        except (TypeError, ValueError):
            return ("reward_bad_output", f"{name} returned {value!r}, not a number")
        if not math.isfinite(value):
            return ("reward_nan", f"{name} returned {value}")
        return value
