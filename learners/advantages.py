"""Advantage estimators as pure torch functions.

Shapes: B sequences, T response tokens (right-padded); `mask` [B, T] is 1 on real tokens.
Sequence-level rewards are [B]; `group_ids` [B] (int) marks the samples of one prompt.

Group estimators (GRPO, RLOO) need every rank to see the whole batch's rewards, which the
learner gives them. Batch-normalised ones (REINFORCE++, GAE whitening) take the moments of the
whole data-parallel batch: compute `masked_moments` per shard, all-reduce (sum), then `whiten`.
"""

from __future__ import annotations

import torch

from learners.losses import check_finite, masked


def _group_sums(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample group size, sum of rewards, sum of squares [B] (each sample gets its group's)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    g = int(inverse.max()) + 1
    count = torch.zeros(g, dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    total = torch.zeros(g, dtype=rewards.dtype).index_add_(0, inverse, rewards)
    sq = torch.zeros(g, dtype=rewards.dtype).index_add_(0, inverse, rewards * rewards)
    return count[inverse], total[inverse], sq[inverse]


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group normalisation [B] (Shao et al. 2024, eq. 3 outcome supervision).

    A_i = (r_i - mean_g r) / (std_g r + eps), std unbiased (as TRL and verl); scale=False gives
    Dr. GRPO's r_i - mean_g r. A group with a single sample in the batch gets A = 0.
    """
    check_finite(rewards=rewards)
    n, total, sq = _group_sums(rewards.double(), group_ids)
    mean = total / n
    adv = rewards.double() - mean
    if scale:
        var = ((sq - n * mean * mean) / (n - 1).clamp(min=1.0)).clamp(min=0.0)
        adv = adv / (var.sqrt() + eps)
    return torch.where(n > 1, adv, torch.zeros_like(adv)).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO leave-one-out baseline [B] (Ahmadian et al. 2024, eq. 4).

    A_i = r_i - (sum_g r - r_i) / (n_g - 1) = n_g / (n_g - 1) (r_i - mean_g r); 0 for singletons.
    """
    check_finite(rewards=rewards)
    n, total, _ = _group_sums(rewards.double(), group_ids)
    adv = rewards.double() - (total - rewards.double()) / (n - 1).clamp(min=1.0)
    return torch.where(n > 1, adv, torch.zeros_like(adv)).to(rewards.dtype)


def token_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards [B, T]: the sequence reward on its last token, minus kl_coef * kl_t on
    every token when the KL is a reward penalty (Ouyang et al. 2022, eq. 2)."""
    check_finite(rewards=rewards, kl=kl)
    maskf = mask.to(rewards.dtype)
    last = (maskf.sum(-1).long() - 1).clamp(min=0)
    out = torch.zeros_like(maskf)
    out[torch.arange(len(rewards)), last] = rewards
    if kl is not None and kl_coef:
        out = out - kl_coef * kl * maskf
    return out * maskf


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s-t) r_s over real tokens [B, T] (REINFORCE++, Hu 2025, eq. 5)."""
    maskf = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running * maskf[:, t]
        out[:, t] = running
    return out * maskf


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, count] over the masked entries of x, in float64; sum it over ranks."""
    xd = masked(x.double(), mask)
    return torch.stack([xd.sum(), (xd * xd).sum(), mask.double().sum()])


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over masked entries, from `masked_moments` (global if all-reduced).

    REINFORCE++ normalises returns over the whole batch this way (Hu 2025, eq. 6); std biased.
    """
    check_finite(x=x)
    s, sq, n = (masked_moments(x, mask) if moments is None else moments).tolist()
    if n < 1:
        return torch.zeros_like(x)
    mean = s / n
    std = max(sq / n - mean * mean, 0.0) ** 0.5
    return (x - mean) / (std + eps) * mask.to(x.dtype)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16). Inputs [B, T].

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0), A_t = delta_t +
    gamma lam A_{t+1}. Returns (advantages, returns = advantages + values), both masked; whiten the
    advantages over the batch before the policy loss.
    """
    check_finite(token_rewards=token_rewards, values=values)
    maskf = mask.to(values.dtype)
    values = values * maskf
    adv = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_v = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(last)
        delta = token_rewards[:, t] + gamma * next_v - values[:, t]
        last = (delta + gamma * lam * last) * maskf[:, t]  # padding after the end stays 0
        adv[:, t] = last
    return adv, (adv + values) * maskf
