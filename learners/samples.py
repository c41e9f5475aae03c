"""What a learner batch's responses look like, for the metrics people read (response length,
truncation, reward spread within groups, each reward by name) and the completions they open
when a reward moves (OUT/completions.jsonl). Computed on rank 0, which holds the groups."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from async_rlhf.messages import Completion, CompletionGroup
from async_rlhf.types import Received, Trajectory
from learners import advantages as adv_fns


def _sampled_tokens(t: Trajectory) -> int:
    """The response tokens the model sampled (an episode's observations left out)."""
    return int(t.loss_mask().sum()) if t.observation_spans else len(t.response_ids)


def sample_stats(items: Sequence[Received]) -> dict[str, Any]:
    """StepMetrics' response_len_mean, response_len_max, response_truncated_frac,
    reward_group_std (mean over groups of the population std of its rewards), groups_zero_adv_frac
    (groups whose rewards are all equal: zero GRPO/RLOO advantage) and reward_parts (each reward's
    mean by name, over the samples it scored)."""
    trajs = [t for r in items for t in r.group.members]
    lengths = [_sampled_tokens(t) for t in trajs]
    stds = [float(np.std([t.reward for t in r.group.members])) for r in items]
    parts: dict[str, list[float]] = {}
    for t in trajs:
        for name, value in t.reward_parts.items():
            parts.setdefault(name, []).append(value)
    return {
        "response_len_mean": float(np.mean(lengths)),
        "response_len_max": max(lengths),
        "response_truncated_frac": sum(not t.finished for t in trajs) / len(trajs),
        "reward_group_std": float(np.mean(stds)),
        "groups_zero_adv_frac": sum(s == 0.0 for s in stds) / len(stds),
        "reward_parts": {name: float(np.mean(values)) for name, values in sorted(parts.items())},
    }


def completion_groups(items: Sequence[Received], *, step: int, groups: int, advantage: str,
                      decode: Callable[[Sequence[int]], str]) -> tuple[CompletionGroup, ...]:
    """The first `groups` groups of the batch that made policy version `step`, decoded. The
    advantage is the sequence advantage learner.advantage (grpo, rloo) gives the rewards as
    scored, within the group; None for the token-level estimators (gae, reinforce_pp)."""
    out = []
    for r in items[:groups]:
        members = r.group.members
        rewards = torch.tensor([t.reward for t in members], dtype=torch.float32)
        same = torch.zeros(len(members), dtype=torch.long)
        fn = {"grpo": adv_fns.grpo_advantages, "rloo": adv_fns.rloo_advantages}.get(advantage)
        adv = fn(rewards, same).tolist() if fn else [None] * len(members)
        responses = tuple(
            Completion(response=decode(t.response_ids.tolist()), reward=t.reward,
                       reward_parts=dict(t.reward_parts), advantage=a, policy_version=t.policy_version,
                       staleness=step - 1 - t.policy_version, tokens=_sampled_tokens(t), finished=t.finished)
            for t, a in zip(members, adv))
        out.append(CompletionGroup(step=step, prompt=decode(members[0].prompt_ids.tolist()),
                                   generator_id=members[0].generator_id, responses=responses))
    return tuple(out)
