"""Advantage estimators against numbers worked out by hand."""

import math

import pytest
import torch

from learners.advantages import (
    discounted_returns,
    gae,
    grpo_advantages,
    masked_moments,
    rloo_advantages,
    token_rewards,
    whiten,
)
from learners.losses import NonFiniteError


def test_grpo_group_normalisation_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0])
    groups = torch.tensor([7, 7, 3, 3, 9])
    # group 7: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.7071; group 3: std 0 -> 0;
    # group 9 has one sample in the batch -> 0.
    adv = grpo_advantages(rewards, groups)
    s = 0.5 / math.sqrt(0.5)
    assert adv.tolist() == pytest.approx([s, -s, 0.0, 0.0, 0.0], abs=1e-5)
    assert grpo_advantages(rewards, groups, scale=False).tolist() == pytest.approx([0.5, -0.5, 0, 0, 0])


def test_rloo_by_hand():
    # rewards 1, 2, 3: baselines (2+3)/2, (1+3)/2, (1+2)/2 -> -1.5, 0, 1.5
    adv = rloo_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 0, 1]))
    assert adv.tolist() == pytest.approx([-1.5, 0.0, 1.5, 0.0])


def test_token_rewards_and_returns_by_hand():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    kl = torch.full((2, 3), 0.1)
    r = token_rewards(torch.tensor([1.0, 2.0]), mask, kl, kl_coef=0.5)
    assert r.flatten().tolist() == pytest.approx([-0.05, -0.05, 0.95, 1.95, 0, 0])
    g = discounted_returns(torch.tensor([[0.0, 0.0, 1.0], [3.0, 0.0, 0.0]]), mask, gamma=0.5)
    assert g.flatten().tolist() == pytest.approx([0.25, 0.5, 1.0, 3.0, 0.0, 0.0])


def test_gae_by_hand():
    # r = [0, 1], V = [0.5, 0.2], gamma 1, lam 0.5:
    # delta_1 = 1 + 0 - 0.2 = 0.8 -> A_1 = 0.8; delta_0 = 0 + 0.2 - 0.5 = -0.3 -> A_0 = -0.3 + 0.4
    adv, ret = gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.2, 9.0]]),
                   torch.tensor([[1, 1, 0]]), gamma=1.0, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.1, 0.8, 0.0])
    assert ret[0].tolist() == pytest.approx([0.6, 1.0, 0.0])


def test_gae_with_lambda_one_is_returns_minus_values():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv, _ = gae(r * mask, v, mask, gamma=0.9, lam=1.0)
    assert torch.allclose(adv, (discounted_returns(r * mask, mask, 0.9) - v) * mask, atol=1e-6)


def test_whiten_by_hand_and_across_shards():
    x = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, biased std sqrt(2/3)
    assert whiten(x, mask)[0].tolist() == pytest.approx([-1.2247449, 0.0, 1.2247449, 0.0])
    # REINFORCE++ on 2 ranks: all-reduced moments give the full batch's normalisation
    g = torch.Generator().manual_seed(2)
    x, mask = torch.randn(6, 4, generator=g), (torch.rand(6, 4, generator=g) > 0.3).long()
    moments = masked_moments(x[:2], mask[:2]) + masked_moments(x[2:], mask[2:])
    sharded = torch.cat([whiten(x[:2], mask[:2], moments), whiten(x[2:], mask[2:], moments)])
    assert torch.allclose(sharded, whiten(x, mask), atol=1e-6)


def test_moments_ignore_non_finite_padding():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), -float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_moments(x, mask).tolist() == [6.0, 14.0, 3.0]  # 1 + 2 + 3, 1 + 4 + 9, count


def test_non_finite_rewards_rejected():
    with pytest.raises(NonFiniteError, match="rewards holds 1 NaN/inf"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(NonFiniteError, match="rewards"):
        rloo_advantages(torch.tensor([float("inf"), 0.0]), torch.tensor([0, 0]))
    with pytest.raises(NonFiniteError, match="values"):
        gae(torch.zeros(1, 2), torch.tensor([[0.0, float("nan")]]), torch.ones(1, 2))
