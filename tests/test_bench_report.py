"""The bench report's pure logic: time to a policy reward, the baseline, and the verdicts the
declared targets give (worked out by hand)."""

from __future__ import annotations

import pytest

from async_rlhf.launch.bench.harness import Target
from async_rlhf.launch.bench.jobs import TARGETS, targets
from async_rlhf.launch.bench.report import Run, Setting, baseline, smoothed, time_to_reward, verdicts
from async_rlhf.launch.bench.stages import Bounds, StageBound


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


def _run(name, k, rate, t09, placement="dedicated", g=1, curve_rewards=(0.2, 0.6), against=None):
    """A Run with just what the verdicts read (a fake window: the rest is never touched)."""
    from types import SimpleNamespace

    window = SimpleNamespace(samples_per_s=rate, reward_s={"0.5": None, "0.8": None, "0.9": t09},
                             reward_final=curve_rewards[-1],
                             policy_curve=_curve([(i, r, 64) for i, r in enumerate(curve_rewards)]))
    setting = Setting(name, placement, k, (), "", generators=g, against=against)
    return Run(setting, window, 0.0, "", "")


def _bounds(gen=20.0, train=11.0, packed=20.0):
    stage = {s: StageBound(s, rate, tokens, 1.0, 1) for s, rate, tokens in
             (("gen", gen, 300.0), ("engine", gen, 400.0), ("train", train, 0.0))}
    return Bounds(stage["gen"], stage["engine"], stage["train"], min(gen, train), packed, [stage])


def test_baseline_is_the_fastest_synchronous_run_and_the_targets_are_ratios_against_it():
    colocated = _run("colocated-k0-g1", 0, 10.0, 60.0, placement="colocated")
    k0 = _run("dedicated-k0-g1", 0, 8.0, 70.0)
    k2 = _run("dedicated-k2-g1", 2, 12.0, 50.0, curve_rewards=(0.2, 0.57), against="dedicated-k0-g1")
    auto = _run("auto-k2", 2, 15.0, 40.0, placement="auto")
    runs = [colocated, k0, k2, auto]
    assert baseline(runs) is colocated
    assert baseline([k2, auto]) is None
    v = {x.target.name: x for x in verdicts(targets([r.setting for r in runs]), runs, _bounds())}
    assert v["baseline_of_train_bound"].value == pytest.approx(10 / 11)
    assert v["baseline_of_train_bound"].met  # >= 0.85
    assert v["speedup_vs_baseline"].value == pytest.approx(1.5) and v["speedup_vs_baseline"].met
    assert v["reward_0.9_speedup_vs_baseline"].value == pytest.approx(60 / 40)
    assert v["reward_per_sample_vs_baseline"].value == pytest.approx(1.0)
    assert v["fraction_of_bound"].value == pytest.approx(15 / 11)
    assert v["fraction_of_packed"].value == pytest.approx(0.75) and v["fraction_of_packed"].met is None
    assert v["gen_tokens_of_engine"].value == pytest.approx(300 / 400)
    # auto (g = 1) against the dedicated k = 0 run with as many generators
    assert v["speedup_vs_sync_same_placement"].value == pytest.approx(15 / 8)
    # the k = 2 setting names the k = 0 one it is compared with; nothing else does
    per_sample = v["reward_per_sample_dedicated-k2-g1_over_dedicated-k0-g1"]
    assert per_sample.value == pytest.approx(((0.2 + 0.57) / 2) / ((0.2 + 0.6) / 2))
    assert per_sample.met  # 0.9625 >= 0.95
    assert v["reward_dedicated-k2-g1_over_dedicated-k0-g1"].value == pytest.approx(0.57 / 0.6)
    assert len(v) == len(TARGETS) + 2
    # a baseline that never reached 0.9: no ratio rather than a made-up one, and no verdict
    colocated.window.reward_s["0.9"] = None
    (late,) = verdicts([TARGETS[2]], runs, _bounds())
    assert late.value is None and late.met is None


def test_a_verdict_is_met_inside_its_declared_range_and_says_so():
    between = Target("x", "samples_per_s", "a", "b", at_least=0.95, at_most=1.05)
    assert [between.judge(v).met for v in (0.94, 0.95, 1.0, 1.05, 1.06)] == [False, True, True, True, False]
    assert Target("y", "samples_per_s", "a", "b", at_least=1.3).judge(1.2).met is False
    assert Target("z", "samples_per_s", "a", "b").judge(5.0).met is None  # reported, not judged
    assert str(between.judge(1.0)) == "x = 1.00 (target >= 0.95 and <= 1.05: met)"
    assert str(Target("z", "samples_per_s", "a", "b").judge(None)) == "z = -"


def test_a_slower_run_fails_the_speedup_target_it_declares():
    base = _run("colocated-k0-g1", 0, 10.0, 60.0, placement="colocated")
    slow = _run("dedicated-k1-g1", 1, 11.0, 55.0)
    (speedup,) = verdicts([TARGETS[1]], [base, slow], _bounds())
    assert speedup.value == pytest.approx(1.1) and speedup.met is False
