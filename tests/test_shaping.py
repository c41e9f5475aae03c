"""Overlong handling and reward shaping before advantages (learners/shaping.py): the pure maths
on hand-worked numbers, and the learner training nothing on a batch of cut responses with
learner.overlong=mask."""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import VOCAB

from async_rlhf.config import LearnerConfig
from async_rlhf.synthetic import random_groups
from async_rlhf.types import Group, Received
from learners.advantages import grpo_advantages
from learners.batch import Batch
from learners.losses import policy_loss
from learners.shaping import RunningMoments, Shaping, soft_overlong_penalty


def test_soft_overlong_penalty_ramps_over_the_buffer():
    lengths = torch.tensor([10, 12, 13, 14, 16, 20])  # limit 16, buffer 4: the ramp is 13..16
    assert soft_overlong_penalty(lengths, 16, 4, 1.0).tolist() == [0, 0, -0.25, -0.5, -1, -1]
    assert soft_overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0, 0, -0.125, -0.25, -0.5, -0.5]


def test_running_moments_over_batches_are_those_of_all_values():
    values = np.random.default_rng(0).normal(3.0, 2.0, 100)
    moments = RunningMoments()
    for chunk in np.split(values, [7, 30, 31, 100]):
        if len(chunk):
            moments.update(torch.tensor(chunk))
    assert moments.count == 100
    assert moments.mean == pytest.approx(values.mean(), abs=1e-12)
    assert moments.std == pytest.approx(values.std(), abs=1e-12)
    again = RunningMoments()
    again.load_state_dict(moments.state_dict())
    assert again.state_dict() == moments.state_dict()


def _batch(lengths: list[int], finished: list[bool], rewards: list[float]) -> Batch:
    (group,) = random_groups(1, vocab=VOCAB, response_len=max(lengths), group_size=len(lengths), seed=1)
    members = tuple(dataclasses.replace(t, response_ids=t.response_ids[:n], behavior_logprobs=t.behavior_logprobs[:n],
                                        finished=f, reward=r)
                    for t, n, f, r in zip(group.members, lengths, finished, rewards))
    return Batch.from_received([Received("0", Group(members))])


def test_overlong_mask_zeroes_the_cut_responses_only():
    batch = _batch([3, 8, 8, 5], [True, False, True, False], [0.0, 1.0, 2.0, 3.0])
    shaped = Shaping(LearnerConfig(overlong="mask"), response_limit=8)(batch)
    assert shaped.mask.sum(1).tolist() == [3, 0, 8, 0]
    assert torch.equal(shaped.rewards, batch.rewards)


def test_soft_overlong_then_normalise_then_clip():
    batch = _batch([4, 6, 7, 8], [True] * 4, [0.0, 1.0, 2.0, 3.0])
    soft = Shaping(LearnerConfig(overlong="soft", overlong_buffer=2), response_limit=8)
    assert soft(batch).rewards.tolist() == [0.0, 1.0, 1.5, 2.0]  # lengths 7 and 8: -0.5 and -1
    shaping = Shaping(LearnerConfig(reward_norm=True, reward_clip=1.0), response_limit=8)
    # rewards 0..3: mean 1.5, std sqrt(1.25); the ends, -+1.34, clipped to -+1
    assert shaping(batch).rewards.tolist() == pytest.approx([-1.0, -0.5 / 1.25**0.5, 0.5 / 1.25**0.5, 1.0])
    assert shaping.moments.count == 4 and shaping.moments.mean == 1.5


@pytest.mark.parametrize("overlong", ["none", "mask"])
def test_the_learner_trains_nothing_on_cut_responses_with_overlong_mask(make_learner, overlong):
    groups = [Group(tuple(dataclasses.replace(t, finished=False) for t in g.members))
              for g in random_groups(2, vocab=VOCAB, seed=8)]
    learner, _, _ = make_learner(groups, mixed_precision="fp32", overlong=overlong)
    before = [p.detach().clone() for p in learner.backend.model.parameters()]
    learner.step()
    changed = any(not torch.equal(a, p) for a, p in zip(before, learner.backend.model.parameters()))
    assert changed == (overlong == "none")


def test_a_sequence_mean_over_cut_responses_counts_only_the_rows_it_trains(make_learner):
    """overlong=mask with seq_mean_token_mean: the rows masked whole are out of the mean's
    count too (as verl counts), so the gradient is that of the trained rows' mean, not half of
    it; their rewards still set their groups' baselines."""
    groups = [Group(tuple(dataclasses.replace(t, finished=i >= 2) for i, t in enumerate(g.members)))
              for g in random_groups(2, vocab=VOCAB, seed=9)]
    learner, _, _ = make_learner(groups, mixed_precision="fp32", overlong="mask",
                                 loss_agg="seq_mean_token_mean", micro_batch=8)
    be, summed = learner.backend, []
    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(groups)])
    mask = batch.mask * batch.finished[:, None]
    logp = be.logprobs(batch.input_ids, batch.attention_mask, batch.positions)[0]
    adv = grpo_advantages(batch.rewards, batch.groups)[:, None] * mask
    loss = policy_loss(logp, logp.detach(), batch.behavior_logp, adv, mask, agg="seq_mean_token_mean",
                       num_tokens=float(mask.sum()), num_seqs=4.0)[0]
    want = torch.autograd.grad(loss, list(be.model.parameters()))
    be.step = lambda critic=False: summed.append([p.grad.clone() for p in be.model.parameters()]) or 1.0
    learner.step()
    for got, ref in zip(summed[-1], want):
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-7), float((got - ref).abs().max())
