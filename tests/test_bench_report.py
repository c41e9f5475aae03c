"""The bench report's pure logic: time to a policy reward, the baseline and the ratios against it
(worked out by hand)."""

from __future__ import annotations

import pytest

from async_rlhf.launch.bench.report import baseline, smoothed, time_to_reward, verdicts


def _curve(points):
    return [{"version": v, "time": t, "reward": r, "n": n, "samples": 64 * v} for v, (t, r, n) in enumerate(points)]


def test_smoothed_weights_each_policy_and_its_neighbours_by_samples():
    curve = _curve([(0.0, 0.0, 64), (10.0, 0.5, 64), (15.0, 1.0, 32), (20.0, 1.0, 64)])
    assert smoothed(curve) == pytest.approx([
        (0 * 64 + 0.5 * 64) / 128,  # the first has one neighbour
        (0 * 64 + 0.5 * 64 + 1.0 * 32) / 160,
        (0.5 * 64 + 1.0 * 32 + 1.0 * 64) / 160,
        1.0,
    ])


def test_time_to_reward_is_when_the_first_smoothed_policy_reaching_it_was_made():
    curve = _curve([(0.0, 0.0, 64), (10.0, 0.5, 64), (15.0, 1.0, 32), (20.0, 1.0, 64)])
    # smoothed: 0.25, 0.4, 0.8, 1.0
    assert time_to_reward(curve, 0.5) == 15.0
    assert time_to_reward(curve, 0.8) == 15.0
    assert time_to_reward(curve, 0.9) == 20.0
    assert time_to_reward(curve[:3], 0.9) is None  # never reached
    # one lucky policy among poor neighbours does not count: (0.1 + 1.0 + 0.1) / 3 = 0.4
    spike = _curve([(0.0, 0.1, 64), (3.0, 0.1, 64), (5.0, 1.0, 64), (9.0, 0.1, 64), (12.0, 0.1, 64)])
    assert time_to_reward(spike, 0.5) is None


def _run(name, k, rate, t09, placement="dedicated", g=1, curve_rewards=(0.2, 0.6)):
    return {"name": name, "max_staleness": k, "samples_per_s": rate, "placement": placement, "generators": g,
            "reward_s": {"0.5": None, "0.8": None, "0.9": t09}, "reward_final": curve_rewards[-1],
            "policy_curve": _curve([(i, r, 64) for i, r in enumerate(curve_rewards)])}


def test_baseline_is_the_fastest_synchronous_run_and_ratios_are_against_it():
    colocated = _run("colocated-k0-g1", 0, 10.0, 60.0, placement="colocated")
    k0 = _run("dedicated-k0-g1", 0, 8.0, 70.0)
    k2 = _run("dedicated-k2-g1", 2, 12.0, 50.0, curve_rewards=(0.2, 0.57))
    auto = _run("auto-k2", 2, 15.0, 40.0, placement="auto")
    runs = [colocated, k0, k2, auto]
    assert baseline(runs) is colocated
    assert baseline([k2, auto]) is None
    bounds = {"train": {"samples_per_s": 11.0}, "min_samples_per_s": 11.0, "packed_samples_per_s": 20.0,
              "gen_tokens_of_engine": 1.0}
    v = verdicts(runs, bounds)
    assert (v["baseline"], v["best_async"]) == ("colocated-k0-g1", "auto-k2")
    assert v["baseline_of_train_bound"] == pytest.approx(10 / 11)
    assert v["speedup_vs_baseline"] == pytest.approx(1.5)
    assert v["reward_0.9_speedup_vs_baseline"] == pytest.approx(60 / 40)
    assert v["reward_per_sample_vs_baseline"] == pytest.approx(1.0)
    assert v["fraction_of_packed"] == pytest.approx(0.75)
    # auto (g = 1) against the dedicated k = 0 run with as many generators
    assert v["speedup_vs_sync_same_placement"] == pytest.approx(15 / 8)
    assert v["reward_per_sample_k2_over_k0_g1"] == pytest.approx(((0.2 + 0.57) / 2) / ((0.2 + 0.6) / 2))
    # a baseline that never reached 0.9: no ratio rather than a made-up one
    colocated["reward_s"]["0.9"] = None
    assert verdicts(runs, bounds)["reward_0.9_speedup_vs_baseline"] is None
