"""`async-rlhf study staleness`: the lag that realises k, the area under the held-out curve, and
a reduced study through the CLI on the real components."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from async_rlhf.launch.study import SYNC, aggregate, area, earlier_runs, plan, plot, run_overrides, write_markdown
from async_rlhf.staleness import lagged_version


def test_lagged_version_generates_with_the_version_k_behind():
    assert lagged_version([0], 0, 0) == 0
    assert lagged_version([0, 1, 2, 3], 3, 0) == 3
    assert lagged_version([0, 1, 2], 2, 4) == 0  # V < k: the initial weights, staleness V
    assert lagged_version([3, 4, 5, 6, 7], 7, 4) == 3
    assert lagged_version([7], 7, 4) == 7  # joined late: the oldest it has, never one it lacks


def _curve(*points, key="eval_reward"):
    return [{"version": v, key: r} for v, r in points]


def test_area_is_the_mean_reward_over_the_versions():
    assert area(_curve((0, 0.0), (10, 1.0)), 10, "eval_reward") == pytest.approx(0.5)
    assert area(_curve((0, 0.2), (5, 0.2), (10, 0.8), (15, 1.0)), 10, "eval_reward") == pytest.approx(0.35)
    with pytest.raises(ValueError, match="from version 0 to 10"):
        area(_curve((5, 0.2), (10, 0.8)), 10, "eval_reward")
    assert area(_curve((0, 0.0), (10, 1.0), key="eval_reward_sampled"), 10, "eval_reward_sampled") == 0.5


def test_aggregate_compares_the_sampled_and_the_greedy_curves_each_on_its_own():
    # greedy flips by a quarter at a time; the sampled reward of the same policy moves smoothly
    runs = [{"loss": "a", "k": k, "curve": [{"version": v, "eval_reward": g, "eval_reward_sampled": s}
                                             for v, g, s in points]}
            for k, points in [(0, [(0, 0.0, 0.2), (10, 1.0, 0.6)]), (4, [(0, 0.0, 0.2), (10, 0.25, 0.5)])]]
    sampled, greedy = aggregate(runs, "sampled"), aggregate(runs, "greedy")
    assert [c["metric"] for c in sampled + greedy] == ["sampled"] * 2 + ["greedy"] * 2
    assert sampled[1]["auc_rel"] == pytest.approx(0.35 / 0.4) and greedy[1]["auc_rel"] == pytest.approx(0.25)
    assert runs[1]["auc"] == {"sampled": pytest.approx(0.35), "greedy": pytest.approx(0.125)}


def test_aggregate_compares_every_loss_with_the_one_synchronous_cell():
    runs = [{"loss": loss, "k": k, "curve": _curve((0, 0.0), (10, top), (20, 1.0))}
            for loss, k, top in [("a", 0, 1.0), ("a", 0, 0.6), ("a", 4, 0.6), ("b", 4, 0.2)]]
    cells = {(c["loss"], c["k"]): c for c in aggregate(runs, "greedy")}
    assert list(cells)[0] == (SYNC, 0) and len(cells) == 3
    # area of (0, 0), (10, top), (20, 1) over 0..20: (2 top + 1) / 4
    assert cells[(SYNC, 0)]["auc_mean"] == pytest.approx(0.65) and cells[(SYNC, 0)]["seeds"] == 2
    assert cells[("a", 4)]["auc_rel"] == pytest.approx(0.55 / 0.65)
    assert cells[("b", 4)]["auc_rel"] == pytest.approx(0.35 / 0.65) and cells[("b", 4)]["auc_sd"] == 0.0


@pytest.mark.parametrize("metrics", [["sampled", "greedy"], ["greedy"]])
def test_the_markdown_has_a_row_per_metric_and_cell_and_each_runs_areas(tmp_path, metrics):
    runs = [{"name": f"x-k{k}-s0", "loss": "x", "k": k, "steps": 10, "wall_s": 60.0, "staleness_hist": {k: 64},
             "curve": [{"version": 0, "eval_reward": 0.0, "eval_reward_sampled": 0.2},
                       {"version": 10, "eval_reward": top, "eval_reward_sampled": 0.6}]} for k, top in [(0, 1.0), (4, 0.5)]]
    report = {"invocations": [{"command": "async-rlhf study ...", "wall_s": 120.0, "runs": 2}], "runs": runs,
              "eval_prompts": 64, "eval_samples": 8, "blind_ceiling": 0.328, "metrics": metrics,
              "cells": [c for m in metrics for c in aggregate(runs, m)]}
    write_markdown(report, tmp_path / "study.md")
    md = (tmp_path / "study.md").read_text()
    assert ("mean of 8 samples per prompt" in md) == ("sampled" in metrics)
    assert "| greedy | x | 4 | 1 | 0.250 | [0.250, 0.250] | 0.500 |" in md
    assert ("| sampled | x | 4 | 1 | 0.400 | [0.400, 0.400] | 1.000 |" in md) == ("sampled" in metrics)
    assert f"| x-k4-s0 | {'0.400 / ' if 'sampled' in metrics else ''}0.250 | {{4: 64}} | 10 | 60 |" in md


def test_aggregate_has_no_ratio_to_a_k0_that_never_learned():
    runs = [{"loss": "a", "k": k, "curve": _curve((0, 0.0), (10, top))} for k, top in [(0, 0.0), (4, 0.5)]]
    assert [c["auc_rel"] for c in aggregate(runs, "greedy")] == [None, None]


@pytest.mark.parametrize("ks,ceiling", [((0,), 0.3), ((0, 4), 0.3), ((0, 4), None)])
def test_the_plot_has_a_panel_per_loss_or_one_for_k0_alone(tmp_path, ks, ceiling):
    # the README's two-seed k = 0 study once crashed here: no loss with k > 0 meant zero panels;
    # a task other than pick (no prompt-blind ceiling: None) crashed drawing the ceiling
    runs = [{"loss": "decoupled-truncate", "k": k, "curve": _curve((0, 0.0), (10, 1.0))} for k in ks]
    plot({"runs": runs, "batch_size": 64, "blind_ceiling": ceiling, "metrics": ["greedy"]}, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 0


def test_plan_runs_k0_once_per_seed_for_all_losses():
    args = argparse.Namespace(staleness="0,4", losses="decoupled-truncate,naive", seeds="0,1")
    names = [r["name"] for r in plan(args)]
    assert names == ["decoupled-truncate-k0-s0", "decoupled-truncate-k0-s1", "decoupled-truncate-k4-s0",
                     "decoupled-truncate-k4-s1", "naive-k4-s0", "naive-k4-s1"]


def test_a_rerun_keeps_the_earlier_runs_whose_config_it_would_run(tmp_path):
    from async_rlhf.config import load_config

    config = str(Path(__file__).resolve().parents[1] / "configs" / "study.yaml")
    out = tmp_path / "study"
    runs = plan(argparse.Namespace(staleness="0,4", losses="naive", seeds="0"))
    for r in runs:  # as the earlier study's `train` jobs saved them
        (out / "runs" / r["name"]).mkdir(parents=True)
        saved = yaml.safe_load(load_config(config, [*run_overrides(r, out, 200), f"job=study-7-{r['name']}"]).to_yaml())
        if r["k"] == 4:
            del saved["generator"]["nice"]  # a key added since: read as its default
        (out / "runs" / r["name"] / "config.yaml").write_text(yaml.safe_dump(saved))
        r["wall_s"] = 60.0
    earlier = [{"command": "async-rlhf study ...", "wall_s": 70.0, "runs": 2}]
    (out / "study.json").write_text(json.dumps({"runs": runs, "invocations": earlier}))

    same = argparse.Namespace(config=config, overrides=[])
    kept, invocations = earlier_runs(same, out, 200)
    assert [r["name"] for r in kept] == ["naive-k0-s0", "naive-k4-s0"] and invocations == earlier
    assert kept[1] == {"name": "naive-k4-s0", "loss": "naive", "k": 4, "seed": 0, "wall_s": 60.0}
    assert earlier_runs(argparse.Namespace(config=config, overrides=["learner.lr=2e-3"]), out, 200) == ([], [])
    assert earlier_runs(same, out, 100) == ([], [])  # other steps
    (out / "runs" / "naive-k0-s0" / "config.yaml").unlink()
    assert [r["name"] for r in earlier_runs(same, out, 200)[0]] == ["naive-k4-s0"]


@pytest.mark.slow
def test_reduced_study_realises_k_and_writes_its_report(tmp_path, tiny_actor_model):
    """k in {0, 2}, one loss, one seed, 4 steps of 8 samples: the k = 2 run trains each step on
    samples exactly min(V, 2) versions old, and the report's three files are written. A rerun with
    a second seed at k = 0 runs that one alone and reports all three."""
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "async_rlhf.launch.cli", "study", "staleness", "--config", "configs/study.yaml",
           "--out", str(out), "--staleness", "0,2", "--losses", "decoupled-truncate", "--seeds", "0",
           "--steps", "4", f"model.path={tiny_actor_model}", "generator.group_size=2",
           "generator.max_inflight=8", "learner.batch_size=8", "learner.micro_batch=4",
           "eval.every=2", "eval.prompts=4", "learner.lr=2e-3"]  # the study's 1e-3 barely moves in 4 steps
    env = {**os.environ, "ASYNC_RLHF_HOME": str(tmp_path / "home")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "study.json").read_text())
    hists = {r["k"]: r["staleness_hist"] for r in report["runs"]}
    assert hists == {0: {"0": 32}, 2: {"0": 8, "1": 8, "2": 16}}
    for r in report["runs"]:
        assert [c["version"] for c in r["curve"]] == [0, 2, 4] and r["lost"] == 0
    cells = report["cells"]  # configs/study.yaml samples (eval.samples): the sampled curve, then the greedy
    assert [(c["metric"], c["k"]) for c in cells] == [("sampled", 0), ("sampled", 2), ("greedy", 0), ("greedy", 2)]
    for base, stale in (cells[:2], cells[2:]):
        assert base["auc_rel"] == 1.0 and stale["auc_rel"] == pytest.approx(stale["auc_mean"] / base["auc_mean"])
    assert all(c["eval_reward_sampled"] is not None for r in report["runs"] for c in r["curve"])
    md = (out / "study.md").read_text()
    assert (out / "study.png").stat().st_size > 0 and "| sampled | decoupled-truncate | 2 |" in md

    cmd[cmd.index("--staleness") + 1], cmd[cmd.index("--seeds") + 1] = "0", "0,1"
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again = json.loads((out / "study.json").read_text())
    assert [r["name"] for r in again["runs"]] == ["decoupled-truncate-k0-s0", "decoupled-truncate-k0-s1",
                                                  "decoupled-truncate-k2-s0"]
    assert [i["runs"] for i in again["invocations"]] == [2, 1]
    assert [r["curve"] for r in again["runs"] if r["seed"] == 0] == [r["curve"] for r in report["runs"]]


@pytest.mark.slow
def test_a_stopped_study_ends_its_runs_and_starts_no_more(tmp_path, tiny_actor_model):
    """SIGTERM (or Ctrl-C) while the first of two runs trains: the run is stopped, the second
    never starts, and the study exits; none of its `train` processes is left."""
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "async_rlhf.launch.cli", "study", "staleness", "--config", "configs/study.yaml",
           "--out", str(out), "--staleness", "0,1", "--losses", "naive", "--seeds", "0", "--parallel", "1",
           "--steps", "100000", f"model.path={tiny_actor_model}", "generator.group_size=2",
           "generator.max_inflight=8", "learner.batch_size=8", "learner.micro_batch=4", "eval.prompts=4"]
    env = {**os.environ, "ASYNC_RLHF_HOME": str(tmp_path / "home")}
    study = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics = out / "runs" / "naive-k0-s0" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert study.poll() is None and time.monotonic() < deadline, study.stdout.read()[-3000:]
        time.sleep(1)
    study.send_signal(signal.SIGTERM)
    output = study.communicate(timeout=120)[0]
    assert study.returncode != 0 and "study stopped" in output, output[-3000:]
    assert not (out / "runs" / "naive-k1-s0.log").exists()
    trains = subprocess.run(["pgrep", "-f", f"job=study-{study.pid}-"], capture_output=True, text=True)
    assert trains.stdout == "", trains.stdout
