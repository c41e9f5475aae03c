"""Held-out evaluation: a fixed prompt set decoded by one policy version and scored by the job's
own rewards (with env.target: episodes, scored by their environment).

`Evaluator.evaluate()` decodes every prompt greedily (`eval_reward`: the mean reward) and, with
`samples` = k > 0, k more samples per prompt at the training temperature (`eval_reward_sampled`,
and `eval_pass@k`: the share of prompts with at least one sample whose reward reaches
`pass_reward`, 1.0 by default: the full score of a built-in task). It needs an engine of its own
with nothing else in flight (the launcher's EvalWorker owns one). A sample whose reward fails is
left out of the means and counted (`eval_failed`).

The prompts (`eval_prompts`): eval.prompts = N draws N from the task's held-out split
(actors.tasks.examples(split="heldout")), which training never draws from; eval.prompts = a JSONL
path reads its records, and refuses the file if any of its prompts is also a training prompt.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

from async_rlhf.config import Config
from async_rlhf.hub import context_length, resolve_model
from async_rlhf.messages import EvalResult
from async_rlhf.protocols import GenerationEngine
from async_rlhf.types import Prompt

from actors.episodes import episodes_of
from actors.prompts import ChatRenderer, PromptStream, load_records
from actors.rewards import Scored, Scorer


class Evaluator:
    def __init__(self, engine: GenerationEngine, prompts: list[Prompt], scorer: Scorer, *,
                 samples: int = 0, pass_reward: float = 1.0):
        if not prompts:
            raise ValueError("evaluation needs at least one prompt (eval.prompts)")
        self.engine, self.prompts, self.scorer = engine, prompts, scorer
        self.samples, self.pass_reward = samples, pass_reward

    def evaluate(self) -> EvalResult:
        """Evaluate the engine's current weights."""
        start = time.perf_counter()
        version = self.engine.policy_version
        greedy = [group[0] for group in self.engine.generate(self.prompts, 1, greedy=True)]
        scored = self.scorer.score_samples(self.prompts, greedy)
        failed = sum(not r.ok for r in scored)
        sampled_reward = pass_at_k = None
        if self.samples:
            k = self.samples
            groups = self.engine.generate(self.prompts, k)
            sampled = self.scorer.score_samples([p for p in self.prompts for _ in range(k)],
                                                [s for group in groups for s in group])
            per_prompt = [sampled[i * k:(i + 1) * k] for i in range(len(self.prompts))]
            sampled_reward = _mean(sampled)
            pass_at_k = sum(any(r.ok and r.reward >= self.pass_reward for r in rs)
                            for rs in per_prompt) / len(self.prompts)
            failed += sum(not r.ok for r in sampled)
        return EvalResult(version, _mean(scored), len(self.prompts), failed, time.perf_counter() - start,
                          samples=self.samples, reward_sampled=sampled_reward, pass_at_k=pass_at_k)


def _mean(scored: list[Scored]) -> float:
    rewards = [r.reward for r in scored if r.ok]
    return sum(rewards) / len(rewards) if rewards else math.nan


def eval_prompts(cfg: Config, tokenizer, max_tokens: int | None = None) -> list[Prompt]:
    """The held-out prompt set eval.prompts names (see the module docstring)."""
    from actors.tasks import examples

    ev, data = cfg.eval, cfg.data
    if isinstance(ev.prompts, int):
        records, name = examples(data.task, ev.seed, ev.prompts, split="heldout"), f"{data.task}-heldout"
    else:
        records = load_records(dataclasses.replace(data, source="jsonl", path=ev.prompts))
        name = ev.prompts
        seen = {json.dumps(p) for p, _ in load_records(data, cfg.seed)}
        shared = [p for p, _ in records if json.dumps(p) in seen]
        if shared:
            raise ValueError(f"{len(shared)} of the {len(records)} prompts in eval.prompts={ev.prompts} "
                             f"are training prompts too (e.g. {shared[0]!r}): held-out prompts must "
                             "never be trained on; remove them from one of the two sets")
    render = ChatRenderer.from_config(tokenizer, data)
    return PromptStream(records, tokenizer, name=name, max_tokens=max_tokens,
                        max_prompt_tokens=cfg.generator.max_prompt_tokens, render=render).prompts


def make_evaluator(cfg: Config, engine: GenerationEngine | None = None, device: str | None = None) -> Evaluator:
    """The job's evaluator: its own engine (generator settings), prompts and scorer."""
    from transformers import AutoConfig, AutoTokenizer

    from actors.engines import make_engine

    g = cfg.generator
    path = resolve_model(cfg.model.path)
    context = context_length(AutoConfig.from_pretrained(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = eval_prompts(cfg, tokenizer, max_tokens=context and context - cfg.response_limit)
    engine = episodes_of(cfg, engine or make_engine(g, path, seed=cfg.seed, device=device,
                                                    model_dtype=cfg.model.dtype), tokenizer)
    return Evaluator(engine, prompts, Scorer.from_specs(cfg.rewards), samples=cfg.eval.samples,
                     pass_reward=cfg.eval.pass_reward)
