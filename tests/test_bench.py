"""`async-rlhf bench` on a tiny configuration: it runs the stage bounds and three whole jobs
(the colocated synchronous baseline, a dedicated k = 2 job and a k = 2 job with placement: auto)
and writes well-formed bench.json, bench.md and bench.png. Not a timing test: throughput figures
are only checked to be positive and finite."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY = """\
job: bench-test
max_staleness: 1
model: {path: MODEL, preset: tiny}
data: {source: task, task: count}
generator: {max_inflight: 8, group_size: 2, max_new_tokens: 8}
learner: {steps: 2, batch_size: 8, micro_batch: 8, wait_s: 120, lr: 1.0e-4}
"""

SETTING_KEYS = ("placement", "max_staleness", "generators", "allocation", "mode", "against")
WINDOW_KEYS = ("samples_per_s", "tokens_per_s", "gen_idle", "learner_idle", "weight_sync_share", "reward_final",
               "staleness_hist", "staleness_mean", "staleness_token_mean", "gen_mean_inflight",
               "gen_inflight_updates", "first_step_s", "reward_s", "startup", "shutdown_s")


def test_bench_tiny_writes_outputs(tmp_path: Path, tiny_actor_model: Path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.replace("MODEL", str(tiny_actor_model)))
    out = tmp_path / "bench"
    env = {**os.environ, "ASYNC_RLHF_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "async_rlhf.launch.cli", "bench", "--config", str(config), "--out", str(out),
           "--staleness", "2", "--generators", "1", "--auto", "2", "--steps", "2", "--warmup", "1",
           "--bound-steps", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]

    report = json.loads((out / "bench.json").read_text())
    assert [(r["setting"]["placement"], r["setting"]["max_staleness"]) for r in report["runs"]] == [
        ("colocated", 0), ("dedicated", 2), ("auto", 2)]
    colocated, dedicated, auto = (r["setting"] for r in report["runs"])
    assert colocated["generators"] == dedicated["generators"] == 1
    config = (out / "runs" / "colocated-k0-g1" / "config.yaml").read_text()
    for line in ("schedule: lockstep", "max_inflight: 8", f"threads: {os.cpu_count()}"):
        assert line in config, line  # the whole batch in one engine call, every core each phase
    # auto sizes the generators from the stage costs measured just before (a busy machine can
    # make generation look dearer): what it ran is what it printed
    assert report["runs"][2]["window"]["placement_chosen"].startswith(
        f"placement auto: {auto['generators']} generator(s)")
    for run in report["runs"]:
        s, r = run["setting"], run["window"]
        assert set(SETTING_KEYS) <= set(s) and set(WINDOW_KEYS) <= set(r)
        assert r["samples_per_s"] > 0 and math.isfinite(r["samples_per_s"])
        assert 0 <= r["learner_idle"] <= 1 and 0 <= r["gen_idle"] <= 1
        assert 0 <= r["reward_final"] <= 1
        assert sum(r["staleness_hist"].values()) == 2 * 8  # timed steps x batch
        assert max(int(k) for k in r["staleness_hist"]) <= s["max_staleness"]
        assert 0 <= r["staleness_token_mean"] <= s["max_staleness"]
        assert 0 <= r["staleness_mean"] <= s["max_staleness"]
        assert 0 < r["gen_mean_inflight"] <= 8
        assert r["accounting"]["lost"] == 0
        # seconds from the command: start-up phases in order, then the first step, then the exit
        phases = list(r["startup"].values())
        assert phases == sorted(phases) and r["startup"]["first_step"] == pytest.approx(r["first_step_s"], abs=0.2)
        assert 0 < r["first_step_s"] < run["job_wall_s"] and 0 <= r["shutdown_s"] < run["job_wall_s"]
        assert set(r["reward_s"]) == {"0.5", "0.8", "0.9"}
        curve = r["policy_curve"]  # one point per generating version, the first the initial policy
        assert curve[0]["version"] == 0 and curve[0]["samples"] == 0
        for a, b in zip(curve, curve[1:]):
            assert a["version"] < b["version"] and a["samples"] < b["samples"]
        assert curve[-1]["version"] <= 2 and all(0 <= p["reward"] <= 1 for p in curve)
    bounds = report["bounds"]
    assert bounds["gen"]["samples_per_s"] > 0 and bounds["train"]["samples_per_s"] > 0
    assert bounds["min_samples_per_s"] == min(bounds["gen"]["samples_per_s"], bounds["train"]["samples_per_s"])
    assert bounds["engine"]["tokens_per_s"] > 0 and bounds["engine"]["detail"]["inflight"] == 8
    assert report["baseline"] == "colocated-k0-g1"
    verdicts = {v["target"]["name"]: v for v in report["verdicts"]}
    assert verdicts["gen_tokens_of_engine"]["value"] == pytest.approx(
        bounds["gen"]["tokens_per_s"] / bounds["engine"]["tokens_per_s"])
    assert {"speedup_vs_baseline", "reward_0.9_speedup_vs_baseline", "reward_per_sample_vs_baseline",
            "baseline_of_train_bound", "fraction_of_bound", "fraction_of_packed"} <= set(verdicts)
    assert verdicts["speedup_vs_baseline"]["target"]["at_least"] == 1.3 and verdicts["speedup_vs_baseline"]["met"] in (
        True, False)

    table = (out / "bench.md").read_text()
    assert "| colocated-k0-g1 (baseline) |" in table and "| dedicated-k2-g1 |" in table
    assert "| auto-k2 |" in table
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("colocated-k0-g1", "dedicated-k2-g1", "auto-k2"):  # each setting is a whole job of its own
        assert (out / "runs" / name / "summary.json").is_file()


def test_bench_modes_are_generator_settings(tmp_path: Path):
    """--modes runs each dedicated setting once per generator mode, with that mode's config."""
    import argparse

    from async_rlhf.launch.bench.jobs import MODES, add_arguments, settings
    from async_rlhf.config import Config, GeneratorConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", "c.yaml", "--out", str(tmp_path), "--staleness", "2",
                              "--generators", "1", "--no-colocated", "--modes", "inflight,lockstep"])
    names = [(s.name, s.mode, s.against) for s in settings(args, Config())]
    assert names == [("dedicated-k2-g1-inflight", "inflight", None), ("dedicated-k2-g1-lockstep", "lockstep", None)]
    # with k = 0 in the list, each asynchronous setting is compared with its mode's k = 0 one
    both = parser.parse_args(["--config", "c.yaml", "--out", str(tmp_path), "--staleness", "0,2",
                              "--generators", "1", "--modes", "lockstep"])
    assert [(s.name, s.against) for s in settings(both, Config())] == [
        ("colocated-k0-g1", None), ("dedicated-k0-g1-lockstep", None),
        ("dedicated-k2-g1-lockstep", "dedicated-k0-g1-lockstep")]
    assert MODES["lockstep"] == ("lockstep", "between_groups")
    for schedule, updates in MODES.values():  # each is a valid config
        GeneratorConfig(schedule=schedule, weight_updates=updates)
    with pytest.raises(SystemExit, match="choose from inflight, between_groups, lockstep"):
        settings(parser.parse_args(["--config", "c", "--out", "o", "--modes", "sometimes"]), Config())
