"""Loss functions against numbers worked out by hand (comments) or in float64."""

import math

import pytest
import torch

from learners.losses import (
    NonFiniteError,
    aggregate,
    behavior_weight,
    dpo_loss,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    sequence_logprob,
    token_logprobs,
    value_loss,
)

LN = math.log


def _one(x):
    return torch.tensor([[x]], dtype=torch.float64)


ONE_MASK = torch.ones(1, 1)


def test_on_policy_token_is_plain_policy_gradient():
    # theta = prox = behaviour: r = 1, w = 1, loss = -A; d loss / d logp = -A r = -A.
    logp = _one(LN(0.5)).requires_grad_()
    loss, stats = policy_loss(logp, _one(LN(0.5)), _one(LN(0.5)), _one(3.0), ONE_MASK)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0)
    assert logp.grad.item() == pytest.approx(-3.0)
    assert stats["clip_frac"] == 0 and stats["bw_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "correction, cap, want_loss, want_w, want_capped",
    [
        # pi_prox = 0.5, pi_behaviour = 0.25: w = 2; theta = prox so r = 1; A = 1.
        ("none", 1.5, -2.0, 2.0, 0.0),  # uncorrected: loss = -A r w = -2
        ("truncate", 3.0, -2.0, 2.0, 0.0),  # under the cap: unchanged
        ("truncate", 1.5, -1.5, 1.5, 1.0),  # TIS: w = min(2, 1.5)
        ("mask", 1.5, 0.0, 0.0, 1.0),  # w > cap: token dropped
    ],
)
def test_stale_token_behaviour_weight(correction, cap, want_loss, want_w, want_capped):
    logp = _one(LN(0.5)).requires_grad_()
    loss, stats = policy_loss(
        logp, _one(LN(0.5)), _one(LN(0.25)), _one(1.0), ONE_MASK, correction=correction, is_cap=cap
    )
    loss.backward()
    assert loss.item() == pytest.approx(want_loss)
    assert logp.grad.item() == pytest.approx(want_loss)  # d(-A w e^(logp - prox))/dlogp at r = 1
    assert stats["bw_mean"] == pytest.approx(want_w)
    assert stats["bw_capped_frac"] == want_capped


def test_clip_is_on_ratio_to_prox_not_behaviour():
    # theta 0.6, prox 0.5, behaviour 0.4: r = 1.2, w = 1.25, eps = 0.1.
    # A = +1: max(-1.2, -1.1) = -1.1 (clipped, no gradient), times w: -1.375.
    # A = -1: max(1.2, 1.1) = 1.2 (unclipped), times w: 1.5.
    args = (_one(LN(0.5)), _one(LN(0.4)))
    for adv, want, clipped in [(1.0, -1.375, 1.0), (-1.0, 1.5, 0.0)]:
        logp = _one(LN(0.6)).requires_grad_()
        loss, stats = policy_loss(logp, *args, _one(adv), ONE_MASK, clip_eps=0.1, is_cap=5.0)
        loss.backward()
        assert loss.item() == pytest.approx(want)
        assert stats["clip_frac"] == clipped
        assert logp.grad.item() == pytest.approx(0.0 if clipped else -adv * 1.2 * 1.25)


@pytest.mark.parametrize(
    "theta, adv, eps_high, want, clipped",
    [
        # prox = behaviour = 0.5 (w = 1), eps = 0.1, eps_high = 0.3.
        (0.6, 1.0, 0.3, -1.2, 0.0),  # r = 1.2 < 1.3: the wider upper bound leaves it unclipped
        (0.6, 1.0, None, -1.1, 1.0),  # unset: the bound is 1 + eps = 1.1 as before
        (0.7, 1.0, 0.3, -1.3, 1.0),  # r = 1.4 clipped to 1.3
        (0.4, -1.0, 0.3, 0.9, 1.0),  # r = 0.8, A < 0: the lower bound stays 1 - eps = 0.9
    ],
)
def test_clip_higher_widens_only_the_upper_bound(theta, adv, eps_high, want, clipped):
    logp = _one(LN(theta)).requires_grad_()
    loss, stats = policy_loss(logp, _one(LN(0.5)), _one(LN(0.5)), _one(adv), ONE_MASK,
                              clip_eps=0.1, clip_eps_high=eps_high)
    loss.backward()
    assert loss.item() == pytest.approx(want)
    assert stats["clip_frac"] == clipped
    # unclipped: d(-A r)/dlogp = -A r; clipped: no gradient
    assert logp.grad.item() == pytest.approx(0.0 if clipped else -adv * theta / 0.5)


def test_plain_ppo_against_behaviour_for_ablation():
    # r = 0.6 / 0.25 = 2.4 clipped to 1.2 with A = 1: loss -1.2; w not applied.
    loss, stats = policy_loss(
        _one(LN(0.6)), _one(LN(0.5)), _one(LN(0.25)), _one(1.0), ONE_MASK, ratio_to="behavior"
    )
    assert loss.item() == pytest.approx(-1.2)
    assert stats["bw_mean"] == 1.0 and stats["clip_frac"] == 1.0


def test_sequence_level_weight_is_product_over_tokens():
    prox = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    behav = torch.tensor([[-0.1, -0.2, -5.0]], dtype=torch.float64)  # last one is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, capped = behavior_weight(prox, behav, mask, "truncate", 10.0, "sequence")
    assert w[0, :2].tolist() == pytest.approx([math.exp(0.3)] * 2)
    w, capped = behavior_weight(prox, behav, mask, "mask", 1.2, "sequence")
    assert w[0, :2].tolist() == [0.0, 0.0] and capped[0].tolist() == [True, True, False]


def test_policy_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    logp, prox, behav = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 1
    loss, _ = policy_loss(logp.float(), prox.float(), behav.float(), adv.float(), mask,
                          clip_eps=0.2, correction="truncate", is_cap=1.5, agg="seq_mean_token_mean")
    want = 0.0
    for i in range(B):
        terms = []
        for t in range(T):
            if mask[i, t]:
                r = math.exp(logp[i, t] - prox[i, t])
                w = min(math.exp(prox[i, t] - behav[i, t]), 1.5)
                a = adv[i, t].item()
                terms.append(w * max(-a * r, -a * min(max(r, 0.8), 1.2)))
        want += sum(terms) / len(terms) / B
    assert loss.item() == pytest.approx(want, rel=1e-5)


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(7 / 3)
    assert aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(values, mask, "seq_mean_token_sum").item() == pytest.approx((3 + 4) / 2)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("splits", [[8], [3, 5], [2, 2, 4], [1] * 8])
def test_loss_and_gradient_do_not_depend_on_sharding(agg, splits):
    g = torch.Generator().manual_seed(1)
    B, T = 8, 7
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    prox = logp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    behav = prox + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).double()
    kw = dict(agg=agg, num_tokens=float(mask.sum()), num_seqs=float(B))

    full_logp = logp.clone().requires_grad_()
    full, _ = policy_loss(full_logp, prox, behav, adv, mask, **kw)
    full.backward()

    shard_logp = logp.clone().requires_grad_()
    total, start = 0.0, 0
    for n in splits:  # each shard is what one rank (or one micro-batch) sees
        s = slice(start, start + n)
        part, _ = policy_loss(shard_logp[s], prox[s], behav[s], adv[s], mask[s], **kw)
        part.backward()
        total += part.item()
        start += n
    assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(shard_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-15)


def test_kl_estimators_by_hand():
    # d = ln 0.5 - ln 0.25 = ln 2: k1 = ln 2, k2 = (ln 2)^2 / 2, k3 = 1/2 - 1 + ln 2.
    logp, ref = _one(LN(0.5)), _one(LN(0.25))
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LN(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(LN(2) ** 2 / 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN(2))
    assert kl_penalty(logp, logp, "k3").item() == 0.0


def test_entropy_and_tempered_logprobs_by_hand():
    logits = torch.tensor([[[0.0, LN(3)]]])  # softmax = [1/4, 3/4]
    assert entropy_from_logits(logits).item() == pytest.approx(-(0.25 * LN(0.25) + 0.75 * LN(0.75)))
    # logits [0, 2] at temperature 2 -> [0, 1]: log p(1) = 1 - ln(1 + e)
    lp = token_logprobs(torch.tensor([[[0.0, 2.0]]]), torch.tensor([[1]]), temperature=2.0)
    assert lp.item() == pytest.approx(1 - LN(1 + math.e))


def test_clipped_value_loss_by_hand():
    # V = 1.0, V_old = 0.5, R = 2, clip 0.2: V_clip = 0.7; 0.5 * max(1, 1.69) = 0.845.
    loss, stats = value_loss(_one(1.0), _one(0.5), _one(2.0), ONE_MASK, clip=0.2)
    assert loss.item() == pytest.approx(0.845)
    assert stats["value_clip_frac"] == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["logp", "prox_logp", "behavior_logp", "advantages"])
def test_non_finite_inputs_are_rejected(bad, where):
    args = {k: torch.zeros(2, 3) for k in ("logp", "prox_logp", "behavior_logp", "advantages")}
    args[where][1, 2] = bad
    with pytest.raises(NonFiniteError, match=f"{where} holds 1 NaN/inf values out of 6"):
        policy_loss(**args, mask=torch.ones(2, 3))
    with pytest.raises(NonFiniteError):
        value_loss(args[where], torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["logp", "prox_logp", "behavior_logp", "advantages"])
def test_non_finite_padding_is_never_used(bad, where):
    # token 0 on-policy (0.5 everywhere), A = 3: loss = -A r w = -3, d loss / d logp = -3;
    # token 1 is padding holding NaN/inf: no part in the loss, zero gradient
    args = {k: torch.tensor([[LN(0.5), LN(0.5)]], dtype=torch.float64)
            for k in ("logp", "prox_logp", "behavior_logp")}
    args["advantages"] = torch.tensor([[3.0, 3.0]], dtype=torch.float64)
    args[where][0, 1] = bad
    args["logp"].requires_grad_()
    mask = torch.tensor([[1.0, 0.0]])
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        for correction, level in [("truncate", "token"), ("mask", "sequence"), ("none", "token")]:
            args["logp"].grad = None
            loss, stats = policy_loss(**args, mask=mask, agg=agg, correction=correction, level=level)
            loss.backward()
            assert loss.item() == pytest.approx(-3.0)
            assert args["logp"].grad.tolist() == [[pytest.approx(-3.0), 0.0]]
            assert stats["ratio_mean"] == pytest.approx(1.0) and stats["bw_max"] == pytest.approx(1.0)


def test_aggregate_and_value_loss_ignore_non_finite_padding():
    values = torch.tensor([[1.0, float("inf")], [float("nan"), -float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    for agg, want in [("token_mean", 1.0), ("seq_mean_token_mean", 0.5), ("seq_mean_token_sum", 0.5)]:
        values.grad = None
        loss = aggregate(values, mask, agg)
        loss.backward()
        assert loss.item() == want
        assert values.grad.tolist() == [[want, 0.0], [0.0, 0.0]]
    # real token: V = 1, V_old = 0.5, R = 0, clip 0.2: V_clip = 0.7; 0.5 * max(1, 0.49) = 0.5,
    # d/dV = V - R = 1; the padded token holds NaN/inf
    nan, inf = float("nan"), float("inf")
    v = torch.tensor([[1.0, nan]], requires_grad=True)
    loss, _ = value_loss(v, torch.tensor([[0.5, inf]]), torch.tensor([[0.0, -inf]]),
                         torch.tensor([[1.0, 0.0]]), clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5)
    assert v.grad.tolist() == [[pytest.approx(1.0), 0.0]]


E20 = math.exp(20.0)  # the largest ratio or weight the loss lets through (verl's clamp at +-20)


@pytest.mark.parametrize(
    "logp, prox, behav, adv, ratio_to, want_loss",
    [
        # log r = +100, A = -1 (fp32: e^100 = inf): loss = max(r, 1.2) * w = e^20 (clamped), w = 1
        (0.0, -100.0, -100.0, -1.0, "prox", E20),
        # A = 0 with r = inf: 0 * inf was NaN; now 0
        (0.0, -100.0, -100.0, 0.0, "prox", 0.0),
        # log r = -100: r = e^-20 ~ 0; A = 1: max(-r, -0.8) = -e^-20, w = 1
        (-100.0, 0.0, 0.0, 1.0, "prox", -math.exp(-20.0)),
        # huge finite behaviour log-prob, plain PPO (r against behaviour): log r = 1e30 -> e^20
        (-1.0, -1.0, -1e30, -1.0, "behavior", E20),
        # same log-prob under decoupled PPO: r = 1, w = e^20 truncated to the cap 2: loss = -A r w = 2
        (-1.0, -1.0, -1e30, -1.0, "prox", 2.0),
    ],
)
def test_extreme_log_ratios_give_finite_loss_and_grads(logp, prox, behav, adv, ratio_to, want_loss):
    logp_t = torch.tensor([[logp]], requires_grad=True)  # float32, where exp overflows at 88.7
    loss, stats = policy_loss(logp_t, torch.tensor([[prox]]), torch.tensor([[behav]]),
                              torch.tensor([[adv]]), ONE_MASK, ratio_to=ratio_to)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert math.isfinite(logp_t.grad.item()) and math.isfinite(stats["ratio_mean"])


def test_behaviour_weight_is_clamped_both_ways():
    # log w = +-100 per token (fp32): w = e^+-20, at token and at sequence level (sum +-200)
    prox = torch.tensor([[0.0, 0.0], [-100.0, -100.0]])
    behav = torch.tensor([[-100.0, -100.0], [0.0, 0.0]])
    for level in ("token", "sequence"):
        w, _ = behavior_weight(prox, behav, torch.ones(2, 2), "none", 2.0, level)
        assert w.tolist() == [[pytest.approx(E20)] * 2, [pytest.approx(math.exp(-20.0))] * 2]


@pytest.mark.parametrize(
    "d, want",
    [
        (-2.0, math.exp(2.0) - 1 - 2),  # in range: e^-d - 1 + d = 4.389, unclamped
        (-100.0, 10.0),  # e^100 overflowed fp32 to inf: d -> -20, e^20 - 21 -> clamped to 10
        (100.0, 10.0),  # e^-100 - 1 + 100 = 99 -> clamped to 10
        (11.5, 10.0),  # just past the clamp: 10.5 -> 10
    ],
)
def test_k3_is_clamped_like_verl(d, want):
    logp = torch.tensor([[d]], requires_grad=True)  # float32
    k3 = kl_penalty(logp, torch.zeros(1, 1), "k3")
    k3.sum().backward()
    assert k3.item() == pytest.approx(want, rel=1e-6)
    assert logp.grad.item() == (pytest.approx(1 - math.exp(-d)) if want < 10 else 0.0)


def _pair(*values):
    return [torch.tensor([v], dtype=torch.float64, requires_grad=True) for v in values]


def test_dpo_sigmoid_and_ipo_on_one_pair_by_hand():
    # chosen gained 0.5 over the reference, rejected lost 0.5: h = 1.
    chosen, rejected, ref_c, ref_r = _pair(-1.0, -2.0, -1.5, -1.5)
    loss, st = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.5)
    # -log sigmoid(0.5) = log(1 + e^-0.5)
    assert loss.item() == pytest.approx(LN(1 + math.exp(-0.5)), abs=1e-12)
    loss.backward()
    # d/d logp_c = -beta sigmoid(-beta h) = -0.5 / (1 + e^0.5); the rejected one's is its negative
    assert chosen.grad.item() == pytest.approx(-0.5 / (1 + math.exp(0.5)), abs=1e-12)
    assert rejected.grad.item() == pytest.approx(0.5 / (1 + math.exp(0.5)), abs=1e-12)
    assert st == pytest.approx({"reward_margin": 0.5, "chosen_logratio": 0.5,
                                "rejected_logratio": -0.5, "pair_accuracy": 1.0})
    # ipo: (h - 1 / (2 beta))^2 = (1 - 2)^2 at beta 0.25; its gradient in logp_c 2 (h - 2) = -2
    chosen, rejected, ref_c, ref_r = _pair(-1.0, -2.0, -1.5, -1.5)
    loss, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.25, loss_type="ipo")
    loss.backward()
    assert loss.item() == pytest.approx(1.0) and chosen.grad.item() == pytest.approx(-2.0)


def test_dpo_against_float64_reference_and_global_pair_count():
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (-5 * torch.rand(6, generator=g, dtype=torch.float64) for _ in range(4))
    beta = 0.3
    want = [math.log1p(math.exp(-beta * ((c[i] - rc[i]) - (r[i] - rr[i])).item())) for i in range(6)]
    loss, st = dpo_loss(c, r, rc, rr, beta=beta)
    assert loss.item() == pytest.approx(sum(want) / 6, abs=1e-12)
    assert st["pair_accuracy"] == pytest.approx(sum(w < math.log(2) for w in want) / 6)
    # two shards with the global count sum to the whole batch's loss
    halves = [dpo_loss(c[s], r[s], rc[s], rr[s], beta=beta, num_pairs=6)[0] for s in (slice(0, 2), slice(2, 6))]
    assert sum(h.item() for h in halves) == pytest.approx(loss.item(), abs=1e-12)


def test_dpo_swapped_chosen_and_rejected_is_another_loss_that_ranks_the_wrong_one_first():
    # the policy prefers the chosen response more than the reference does (h = 2)
    c, r, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in (-1.0, -3.0, -2.0, -2.0))
    right, st = dpo_loss(c, r, rc, rr, beta=1.0)
    wrong, st_swapped = dpo_loss(r, c, rr, rc, beta=1.0)
    assert right.item() == pytest.approx(LN(1 + math.exp(-2)))
    assert wrong.item() == pytest.approx(LN(1 + math.exp(2)))
    assert st["pair_accuracy"] == 1.0 and st_swapped["pair_accuracy"] == 0.0
    assert st["reward_margin"] == pytest.approx(2.0) and st_swapped["reward_margin"] == pytest.approx(-2.0)


def test_sequence_logprob_sums_or_averages_real_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, math.nan], [-4.0, math.inf, math.inf]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert sequence_logprob(logp, mask).tolist() == [-3.0, -4.0]
    assert sequence_logprob(logp, mask, length_norm=True).tolist() == [-1.5, -4.0]
