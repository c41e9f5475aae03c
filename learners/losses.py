"""Policy, KL, entropy, value and preference (DPO, IPO) losses as pure torch functions.

Shapes: B sequences, T response tokens (right-padded), V vocabulary. `mask` [B, T] is 1 on real
response tokens and 0 on padding. Log-probs are of the sampled tokens:
    logp          log pi_theta(a_t | s_t), the policy being trained (carries the gradient)
    prox_logp     log pi_prox, the learner's policy when the batch was consumed (recomputed)
    behavior_logp log pi_behaviour, the sampling distribution the generator actually used

Aggregation: every loss is a sum of per-token or per-sequence terms divided by a count. Pass the
GLOBAL count (all data-parallel ranks, all micro-batches of the optimizer step) as `num_tokens` /
`num_seqs`; then summing the per-shard results over shards gives the full-batch loss whatever the
split (tested in tests/test_losses.py). Without counts the local ones are used.

Padding is never used: values there may be anything, NaN and inf included. Masks select
(torch.where), never multiply (inf * 0 is NaN, in the value and in the gradient), and
log-ratios are clamped before every exp, so extreme finite inputs give finite losses and grads.
"""

from __future__ import annotations

from typing import Literal

import torch

Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
Correction = Literal["none", "truncate", "mask"]

# verl's bounds (core_algos.py: compute_policy_loss_vanilla clamps log-ratios to +-20, kl_penalty
# its k3 estimate to +-10): exp(20) ~ 4.9e8 keeps ratios, weights and losses finite in fp32/bf16;
# only a token whose probability ratio is beyond e^+-20 loses its gradient.
_MAX_LOG_RATIO = 20.0
_MAX_KL = 10.0


class NonFiniteError(ValueError):
    """A loss or advantage input holds NaN or inf: the batch must not be trained on."""


def check_finite(mask: torch.Tensor | None = None, /, **tensors: torch.Tensor | None) -> None:
    """Raise NonFiniteError naming the first tensor that holds NaN/inf, and how many; with a
    mask [B, T], only real tokens are checked (padding is never used)."""
    for name, x in tensors.items():
        if x is None or not x.is_floating_point():
            continue
        bad, n = ~torch.isfinite(x), x.numel()
        if mask is not None:
            bad, n = bad & mask.bool(), int(mask.bool().sum())
        if bool(bad.any()):
            raise NonFiniteError(
                f"{name} holds {int(bad.sum())} NaN/inf values out of {n}: this batch is "
                "not trained on; check the reward function and the generator's log-probs "
                "(or lower the learning rate if the learner's own log-probs diverged)"
            )


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x on real tokens, 0 on padding, by selection: the gradient there is 0 whatever x holds."""
    return torch.where(mask.bool(), x, 0.0)


def exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) with log_ratio clamped to +-_MAX_LOG_RATIO: finite for any finite input; a
    clamped entry passes no gradient."""
    return torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: Agg,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar.

    token_mean:          sum_{i,t} m x / N_tokens                 (DAPO, Yu et al. 2025, eq. 8)
    seq_mean_token_mean: sum_i (sum_t m x / |o_i|) / N_seqs       (GRPO, Shao et al. 2024, eq. 3)
    seq_mean_token_sum:  sum_i (sum_t m x) / N_seqs               (REINFORCE-style sequence sum)
    N_tokens, N_seqs are global counts when given (see module docstring).
    """
    real = masked(values, mask)
    mask = mask.to(values.dtype)
    if mode == "token_mean":
        n = mask.sum() if num_tokens is None else num_tokens
        return real.sum() / max(float(n), 1.0)
    per_seq = real.sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1.0)
    elif mode != "seq_mean_token_sum":
        raise ValueError(
            f"loss aggregation {mode!r} unknown: use token_mean, seq_mean_token_mean or "
            "seq_mean_token_sum"
        )
    n = values.shape[0] if num_seqs is None else num_seqs
    return per_seq.sum() / max(float(n), 1.0)


def behavior_weight(
    prox_logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction,
    cap: float,
    level: Literal["token", "sequence"] = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """w = pi_prox / pi_behaviour per token [B, T], and a bool [B, T] of tokens it capped.

    token level: w_t = exp(prox_logp_t - behavior_logp_t); sequence level: one weight per
    sequence, exp(sum_t m (prox_logp_t - behavior_logp_t)), repeated over its tokens
    (verl rollout_corr_helper, sequence IS). truncate: min(w, cap) (TIS, Yao et al. 2025);
    mask: w set to 0 where w > cap (AReaL behav_imp_weight_cap); none: w as is. The log-weight
    is clamped to +-20 before the exp (see exp_ratio).
    """
    log_w = masked(prox_logp - behavior_logp, mask)
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(prox_logp)
    w = exp_ratio(log_w).detach()
    capped = (w > cap) & mask.bool()
    if correction == "truncate":
        w = w.clamp(max=cap)
    elif correction == "mask":
        w = torch.where(capped, torch.zeros_like(w), w)
    elif correction == "none":
        capped = torch.zeros_like(capped)
    else:
        raise ValueError(f"correction {correction!r} unknown: use none, truncate or mask")
    return w, capped


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    correction: Correction = "truncate",
    is_cap: float = 2.0,
    level: Literal["token", "sequence"] = "token",
    ratio_to: Literal["prox", "behavior"] = "prox",
    agg: Agg = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss (Hilton et al. 2021, eq. 6; AReaL ppo_actor_loss_fn). All inputs [B, T].

    loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps_high)), r_t = pi_theta / pi_prox,
    w_t = pi_prox / pi_behaviour corrected by `correction` (see behavior_weight). eps_high is
    clip_eps_high, or clip_eps when None (DAPO's clip-higher, Yu et al. 2025, eq. 10).
    ratio_to="behavior" is plain PPO (Schulman et al. 2017, eq. 7) with r = pi_theta /
    pi_behaviour and no w, for ablation. log r is clamped to +-20 (verl). Returns (scalar loss,
    stats); stats are local means over the masked tokens: clip_frac, ratio_mean, bw_mean, bw_max,
    bw_capped_frac. Raises NonFiniteError for NaN/inf on a real token; padding may hold anything.
    """
    check_finite(mask, logp=logp, prox_logp=prox_logp, behavior_logp=behavior_logp, advantages=advantages)
    logp, prox_logp, behavior_logp, advantages = (
        masked(x, mask) for x in (logp, prox_logp, behavior_logp, advantages))
    maskf = mask.to(logp.dtype)
    if ratio_to == "prox":
        w, capped = behavior_weight(prox_logp, behavior_logp, mask, correction, is_cap, level)
        anchor = prox_logp
    elif ratio_to == "behavior":
        w, capped = torch.ones_like(logp), torch.zeros_like(mask, dtype=torch.bool)
        anchor = behavior_logp
    else:
        raise ValueError(f"ratio_to {ratio_to!r} unknown: use prox or behavior")
    ratio = exp_ratio(logp - anchor.detach())
    unclipped = -advantages * ratio
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped) * w
    loss = aggregate(per_token, mask, agg, num_tokens, num_seqs)

    n = maskf.sum().clamp(min=1.0)
    with torch.no_grad():
        stats = {
            "clip_frac": float(((clipped > unclipped).to(maskf.dtype) * maskf).sum() / n),
            "ratio_mean": float((ratio * maskf).sum() / n),
            "bw_mean": float((w * maskf).sum() / n),
            "bw_max": float((w * maskf).max()) if mask.any() else 0.0,
            "bw_capped_frac": float((capped.to(maskf.dtype) * maskf).sum() / n),
        }
    return loss, stats


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Literal["k1", "k2", "k3"]
) -> torch.Tensor:
    """Per-token estimate [B, T] of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL").

    with d = logp - ref_logp: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d. k3 as verl computes it:
    d clamped to +-20 before the exp, the estimate (>= 0) to at most 10, where it passes no
    gradient (reached at d ~ -2.6 or d ~ 11).
    """
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.expm1(-d) + d).clamp(max=_MAX_KL)
    raise ValueError(f"kl_estimator {estimator!r} unknown: use k1, k2 or k3")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [B, T] of softmax(logits [B, T, V]): logsumexp(z) - sum softmax(z) z."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) [B, T] under log_softmax(logits [B, T, V] / temperature).

    The generators sample at `temperature` and report log-probs of that distribution, so the
    learner's pi_theta and pi_prox must use the same one.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
    agg: Agg = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (PPO2 baselines; OpenRLHF ValueLoss). Inputs [B, T].

    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), aggregated by `agg`.
    Raises NonFiniteError for NaN/inf on a real token; padding may hold anything.
    """
    check_finite(mask, values=values, old_values=old_values, returns=returns)
    values, old_values, returns = (masked(x, mask) for x in (values, old_values, returns))
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    loss = aggregate(per_token, mask, agg, num_tokens, num_seqs)
    maskf = mask.to(values.dtype)
    n = maskf.sum().clamp(min=1.0)
    with torch.no_grad():
        frac = (((v_clipped - returns) ** 2 > (values - returns) ** 2).to(maskf.dtype) * maskf).sum() / n
        mean = (values * maskf).sum() / n
    return loss, {"value_clip_frac": float(frac), "value_mean": float(mean)}


def sequence_logprob(logp: torch.Tensor, mask: torch.Tensor, *, length_norm: bool = False) -> torch.Tensor:
    """log pi(response) [B] from token log-probs [B, T]: sum_t m logp_t, or with length_norm the
    mean over the response's tokens (SimPO's length-normalised reward, Meng et al. 2024)."""
    total = masked(logp, mask).sum(-1)
    return total / mask.to(logp.dtype).sum(-1).clamp(min=1.0) if length_norm else total


def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    *,
    beta: float,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
    num_pairs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Preference loss over P pairs; inputs [P], sequence log-probs (sequence_logprob) of the
    chosen and rejected responses under the policy and the frozen reference.

    h = (logp_c - ref_c) - (logp_r - ref_r);
    sigmoid: -log sigmoid(beta h)           (DPO, Rafailov et al. 2023, eq. 7)
    ipo:     (h - 1 / (2 beta))^2           (IPO, Azar et al. 2023, eq. 17)
    summed over pairs and divided by num_pairs (global, see module docstring; default P).
    Returns (loss, stats); stats are local means over the pairs: reward_margin = beta h,
    chosen_logratio = logp_c - ref_c, rejected_logratio = logp_r - ref_r, pair_accuracy = the
    share of pairs whose implicit reward ranks the chosen response first (h > 0).
    """
    check_finite(chosen_logp=chosen_logp, rejected_logp=rejected_logp,
                 ref_chosen_logp=ref_chosen_logp, ref_rejected_logp=ref_rejected_logp)
    chosen_ratio = chosen_logp - ref_chosen_logp
    rejected_ratio = rejected_logp - ref_rejected_logp
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        per_pair = -torch.nn.functional.logsigmoid(beta * h)
    elif loss_type == "ipo":
        per_pair = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"dpo loss {loss_type!r} unknown: use sigmoid or ipo")
    n = h.shape[0] if num_pairs is None else num_pairs
    loss = per_pair.sum() / max(float(n), 1.0)
    with torch.no_grad():
        stats = {
            "reward_margin": float((beta * h).mean()),
            "chosen_logratio": float(chosen_ratio.mean()),
            "rejected_logratio": float(rejected_ratio.mean()),
            "pair_accuracy": float((h > 0).to(h.dtype).mean()),
        }
    return loss, stats
