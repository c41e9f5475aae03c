"""Held-out evaluation: the split is disjoint from training by construction, the eval config, and
the evaluator's arithmetic (pure logic, on a scripted engine). tests/test_job.py runs it in a job."""

import json
import random

import numpy as np
import pytest

from actors.evaluate import Evaluator, eval_prompts
from actors.prompts import TASK_POOL_SIZE, load_records
from actors.rewards import Scorer
from actors.tasks import PICK_LETTERS, TASKS, examples, is_heldout, prompt_blind_ceiling, score
from async_rlhf.config import ConfigError, DataConfig, load_config
from async_rlhf.messages import EvalResult
from async_rlhf.types import Prompt, Sample


@pytest.mark.parametrize("task", sorted(TASKS))
def test_heldout_prompts_never_appear_in_training(task):
    """Training draws its whole pool (what generators cycle through) from the train split; the
    held-out prompts of any seed are none of them."""
    train = {text for text, _ in load_records(DataConfig(task=task), seed=0)}
    assert len(load_records(DataConfig(task=task), seed=0)) == TASK_POOL_SIZE
    assert not any(is_heldout(t) for t in train)
    for seed in (0, 1):
        heldout = {text for text, _ in examples(task, seed, 256, split="heldout")}
        assert heldout and not heldout & train


@pytest.mark.parametrize("task", ["length", "pick"])
def test_without_the_split_the_same_draws_would_overlap(task):
    """The check above has teeth: drawing as many prompts of the task without the split hits
    training prompts."""
    train = {text for text, _ in load_records(DataConfig(task=task), seed=0)}
    make, rng = TASKS[task].make, random.Random(f"{task}/0/heldout")
    assert {make(rng)[0] for _ in range(256)} & train


def test_eval_prompts_from_a_jsonl_file_must_not_be_training_prompts(tmp_path, tiny_actor_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_actor_model)
    heldout, train = examples("count", 0, 2, split="heldout"), examples("count", 0, 1)
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in heldout))
    cfg = load_config(overrides=["eval.every=1", f"eval.prompts={path}"])
    assert [p.text for p in eval_prompts(cfg, tok)] == [p for p, _ in heldout]
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in heldout + train))
    with pytest.raises(ValueError, match="1 of the 3 prompts in eval.prompts=.* are training prompts"):
        eval_prompts(cfg, tok)
    counted = load_config(overrides=["eval.every=1", "eval.prompts=5", "data.task=pick"])
    assert [p.text for p in eval_prompts(counted, tok)] == [p for p, _ in examples("pick", 0, 5, "heldout")]


def test_eval_config():
    assert load_config(overrides=["eval.prompts=12"]).eval.prompts == 12
    for override, message in [
        ("eval.prompts=0", "eval.prompts must be > 0 (or a JSONL path), got 0"),
        ("eval.prompts=nofile.jsonl", "eval.prompts must be a prompt count or the path of an existing JSONL"),
        ("eval.every=-1", "eval.every must be >= 0"),
        ("generator.weight_lag=3", "generator.weight_lag must be <= max_staleness (2), got 3"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(overrides=[override])
    with pytest.raises(ConfigError, match="a JSONL path with data.source=jsonl"):
        load_config(overrides=["eval.every=1", "data.source=jsonl", "data.path=x.jsonl"])


def test_pick_rewards_and_its_prompt_blind_ceiling():
    p = Prompt("p", (1,), "pick 123 c=", "c")
    assert score([p] * 4, ["cccc", "cc", "cacb", ""]) == [1.0, 1.0, 0.5, 0.0]
    pairs = examples("pick", 0, 400)
    freq = max(sum(a == c for _, a in pairs) for c in PICK_LETTERS) / len(pairs)
    assert prompt_blind_ceiling(pairs) == pytest.approx(freq) and 0.25 <= freq < 0.3
    prompts = [Prompt("p", (1,), t, a) for t, a in pairs]
    rng = random.Random(0)
    for _ in range(50):  # no response, given to every prompt alike, beats the ceiling
        response = "".join(rng.choice(PICK_LETTERS + "xy") for _ in range(rng.randint(1, 12)))
        assert np.mean(score(prompts, [response] * len(prompts))) <= prompt_blind_ceiling(pairs) + 1e-9


class _ScriptedEngine:
    """Greedy answers the prompt's own answer for even prompt ids; samples cycle through
    `sampled` (texts)."""

    policy_version = 7

    def __init__(self, sampled):
        self.sampled = sampled

    def generate(self, prompts, n, *, greedy=False):
        def sample(text):
            return Sample(np.zeros(1, np.int32), np.zeros(1, np.float32), True, ((7, 0),), text)

        if greedy:
            return [[sample(p.answer if int(p.prompt_id) % 2 == 0 else "x")] for p in prompts]
        return [[sample(self.sampled[j]) for j in range(n)] for _ in prompts]


def test_evaluator_scores_greedy_and_pass_at_k():
    prompts = [Prompt(str(i), (1,), f"pick 1 {c}=", c) for i, c in enumerate("abcd")]
    scorer = Scorer.from_specs(load_config().rewards)
    out = Evaluator(_ScriptedEngine(["zz", "a", "bb"]), prompts, scorer, samples=3).evaluate()
    assert out.policy_version == 7 and out.prompts == 4 and out.failed == 0
    assert out.reward == 0.5  # prompts 0 and 2 answered
    assert out.pass_at_k == 0.5  # "a" passes prompt a, "bb" prompt b
    assert out.reward_sampled == pytest.approx(2 / 12)
    assert set(out.scalars()) == {"eval_reward", "eval_prompts", "eval_failed", "eval_s", "eval_reward_sampled",
                                  "eval_pass@3"}  # metrics.jsonl's and TensorBoard's keys
    assert EvalResult.from_json(out.to_json()) == out
    greedy_only = Evaluator(_ScriptedEngine([]), prompts, scorer).evaluate()
    assert greedy_only.pass_at_k is None and greedy_only.reward_sampled is None
    assert set(greedy_only.scalars()) == {"eval_reward", "eval_prompts", "eval_failed", "eval_s"}
    assert EvalResult.from_json(greedy_only.to_json()) == greedy_only
