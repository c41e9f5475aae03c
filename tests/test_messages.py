"""The typed messages and every reader of them, fast: a step's metrics, a generator's stats, the
job's summary and its status go to their flat JSON and back unchanged, and through each
consumer (metrics.jsonl + TensorBoard + console, the bench's and the study's summaries of a run,
`status`). A field renamed on one side fails here, not at the end of a bench."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from async_rlhf.launch.bench.report import summarise
from async_rlhf.launch.metrics import MetricsLog, StepRecord
from async_rlhf.launch.study import summarise_run
from async_rlhf.messages import (Accounting, CoordinatorSnapshot, EvalResult, GeneratorStats, GeneratorTotals, JobSnapshot,
                                 JobStatus, JobSummary, LearnerStatus, StepMetrics, StepTimes, not_trained)


def _step(version: int, **changes) -> StepMetrics:
    m = StepMetrics(
        version=version, loss=0.25, loss_policy=0.3, entropy=1.5, clip_frac=0.1, ratio_mean=1.0, bw_mean=0.9,
        bw_capped_frac=0.05, bw_max=1.2, grad_norm=0.7, lr=1e-4, skipped_nonfinite=0, samples=8,
        samples_fresh=8, tokens=64, reward_mean=0.5, groups=2, group_size_min=4, groups_singleton=0, staleness_max=1,
        staleness_mean=0.5, staleness_hist={0: 4, 1: 4}, staleness_token_mean=0.25,
        reward_by_version={version - 1: (4, 0.5), max(version - 2, 0): (4, 0.25)},
        trained_by_generator={"gen-0": 8},
        times=StepTimes(wait=0.5, recompute=0.1, forward=0.2, backward=0.3, step=0.05, weight_gather=0.01,
                        publish=0.02),
        counts={"samples": 8 * version, "groups": 2 * version, "rejected_token_id": 1},
        weight_sync_s=0.03, weight_sync_bytes=1000, weight_sync_failures=0, extra={"kl": 0.01})
    return dataclasses.replace(m, **changes)


def _gen(**changes) -> GeneratorStats:
    s = GeneratorStats(
        generator_id="gen-0", policy_version=3, schedule="stream", update_mode="inflight", prompt_start=0,
        prompt_position=12, produced=24, groups=12, tokens=480, steps=100, aborted=0,
        set_aside={"reward_nan": 1}, set_aside_total=1, dropped_uniform=2, dead_letter_errors=0, weight_updates=3,
        inflight_updates=2, run_s=10.0, generate_s=6.0, score_s=1.0, put_s=0.5, idle_s=3.0,
        weight_update_s=0.5, weight_wait_s=0.1, mean_inflight=7.5, sequences=8, updates_waiting=0, tokens_per_s=80.0, last_mean_reward=0.5,
        node="host", pid=123, node_id="abc")
    return dataclasses.replace(s, **changes)


def _summary() -> JobSummary:
    acc = Accounting.from_counters({"produced": 10, "foreign": 1, "trained": 8, "dropped_stale": 1,
                                    "reclaimed": 2, "set_aside": 1, "set_aside:reward_nan": 1,
                                    "copied": 1, "dropped_uniform": 3}, left_in_queue=1, foreign_backlog=0)
    return JobSummary(acc, (_gen(),), wall_s=30.0, redis_restarts=0, generator_stalls=1,
                      learner_restarts=2, learner_hangs=1, startup={"first_step": 9.5}, placement="manual", shutdown_s=2.0)


def test_step_metrics_go_to_a_flat_row_and_back():
    m = _step(3)
    row = json.loads(json.dumps(m.to_json()))
    assert row["time_wait"] == 0.5 and row["time_checkpoint"] == 0.0 and row["count_rejected_token_id"] == 1
    assert row["kl"] == 0.01 and row["staleness_hist"] == {"0": 4, "1": 4} and row["reward_by_version"]["2"] == [4, 0.5]
    assert StepMetrics.from_json(row) == m
    assert pickle.loads(pickle.dumps(m)) == m  # how it crosses Ray
    with pytest.raises(TypeError):  # a field the row lacks
        StepMetrics.from_json({k: v for k, v in row.items() if k != "loss"})


def test_accounting_interprets_the_stream_counters():
    acc = _summary().accounting
    assert (acc.produced, acc.foreign, acc.trained, acc.dropped_stale) == (10, 1, 8, 1)
    assert acc.acked_other == {"copied": 1} and acc.set_aside == {"set_aside:reward_nan": 1}
    assert acc.lost == 10 + 1 - 8 - 1 - 1 - 1 == 0
    assert not_trained(acc.counters) == 2  # dropped_stale and copied; events are no outcome
    assert acc.dropped_uniform == 3  # groups never put: no part of produced
    assert _summary().line() == ("summary: produced=10, foreign=1, trained=8, dropped_stale=1, dead_lettered=0, "
                                 "copied=1, left_in_queue=1, lost=0, dropped_uniform=3")  # other ack reasons too: it adds up


def test_summary_goes_to_json_and_back():
    s = _summary()
    d = json.loads(json.dumps(s.to_json()))
    assert d["unit"] == "groups" and d["lost"] == 0 and d["generators"][0]["produced"] == 24
    assert (d["generator_stalls"], d["learner_restarts"], d["learner_hangs"]) == (1, 2, 1)
    assert "error" not in d and d["shutdown_s"] == 2.0
    assert JobSummary.from_json(d) == s
    failed = JobSummary(None, (), wall_s=1.0, redis_restarts=0, generator_stalls=0, learner_restarts=0,
                        learner_hangs=0, startup={},
                        placement="manual", error="boom\nmore")
    assert JobSummary.from_json(json.loads(json.dumps(failed.to_json()))) == failed
    assert failed.line() == "summary: ; error: boom"


def _write_run(run_dir, rows: list[StepRecord]) -> None:
    log = MetricsLog(run_dir, steps=len(rows))
    for r in rows:
        log.step(r)
    log.close()
    (run_dir / "summary.json").write_text(json.dumps(_summary().to_json()))


def test_a_job_record_reaches_metrics_jsonl_tensorboard_the_console_and_the_bench(tmp_path, capsys):
    gens = [_gen(), _gen(generator_id="gen-1", tokens=20, tokens_per_s=20.0)]
    rows = [StepRecord.of(_step(v), time=10.0 * v, step_s=4.0, gen_stats=[dataclasses.replace(
                g, tokens=g.tokens * v, idle_s=g.idle_s * v, generate_s=g.generate_s * v) for g in gens],
                          generators=2, evals=[EvalResult(v, 0.5, 6, 0, 1.5)] if v == 4 else [])
            for v in range(1, 5)]
    assert rows[0].gen_totals.tokens == 500 and rows[0].gen_tokens_per_s == 100.0
    _write_run(tmp_path, rows)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert (first["step"], first["policy_version"], first["samples_per_s"], first["weight_sync_share"]) == (
        1, 1, 2.0, pytest.approx(0.03 / 4))
    assert first["gen_totals"]["idle_s"] == 6.0 and "evals" not in first and "evals" in json.loads(lines[-1])
    assert [StepRecord.from_json(json.loads(line)) for line in lines] == rows
    assert {"loss", "time_wait", "count_samples", "samples_per_s", "gen_tokens_per_s", "kl"} <= set(rows[0].scalars())
    tb = EventAccumulator(str(tmp_path / "tensorboard"))
    tb.Reload()
    assert [(s.step, s.value) for s in tb.Scalars("loss")] == [(v, 0.25) for v in range(1, 5)]
    out = capsys.readouterr().out
    assert "step    1/4  reward 0.500  loss +0.2500  staleness max 1 mean 0.50  2.0 samples/s  sync 30 ms" in out
    assert "turns/episode" not in out  # completions
    episodes = StepRecord.of(_step(1), time=1.0, step_s=1.0, generators=1,
                             gen_stats=[_gen(episodes=4, turns=10), _gen(episodes=4, turns=7)])
    assert episodes.console_line(4).endswith("t 1s  turns/episode 2.12")
    assert "uniform dropped" not in out  # dynamic sampling off: no window, no rate
    sampling = StepRecord.of(_step(1), time=1.0, step_s=1.0, generators=2, gen_stats=[
        _gen(recent_drawn=32, recent_dropped=24, admitted_uniform=5), _gen(recent_drawn=8, recent_dropped=2)])
    assert sampling.uniform_drop_rate == 26 / 40 and sampling.gen_totals.admitted_uniform == 5
    assert sampling.console_line(4).endswith("t 1s  uniform dropped 65% (5 admitted past the bound)")
    assert StepRecord.from_json(json.loads(json.dumps(sampling.to_json()))) == sampling

    bench = summarise(tmp_path, warmup=1)
    assert bench.timed_steps == 3 and bench.window_s == 30.0 and bench.samples_per_s == 24 / 30
    assert bench.gen_idle == pytest.approx(18 / (18 + 36))  # idle / (idle + generate + loads) in the window
    assert bench.learner_idle == pytest.approx(3 * 0.5 / 30) and bench.staleness_hist == {"0": 12, "1": 12}
    assert bench.accounting == {"produced": 10, "trained": 8, "dropped_stale": 1, "lost": 0}
    assert bench.gen_mean_inflight == 7.5 and bench.shutdown_s == 2.0
    assert [p["version"] for p in bench.policy_curve] == [0, 1, 2, 3]

    study = summarise_run(tmp_path, batch_size=8)
    assert study["curve"] == [{"version": 4, "samples": 32, "eval_reward": 0.5, "eval_reward_sampled": None}]
    assert study["staleness_hist"] == {0: 16, 1: 16} and study["lost"] == 0 and study["startup_first_step_s"] == 9.5


def test_status_reads_the_published_snapshot():
    snap = JobSnapshot(job="j", out="/o", learner=LearnerStatus(step=3, policy_version=3, reward_mean=0.5,
                                                                of_steps=10, pid=7, restarts=1, hangs=1),
                       generators=(_gen(error="Traceback..."),), generator_restarts=2, generator_stalls=1)
    acc = _summary().accounting
    published = JobStatus("j", CoordinatorSnapshot(snap, 16, 8, {3: "requested"}), "redis://:***@h:1",
                          "experience", acc, at=1000.0)
    status = JobStatus.from_json(json.loads(json.dumps(dataclasses.asdict(published))))  # the file, read back
    assert status == published
    assert status.lines(now=1001.0) == [
        "job j: learner step 3 policy_version 3  restarts: learner 1 (1 hung), generators 2; stalled generators 1",
        "     gen-0  node host  pid 123  policy_version 3  produced 24  ERROR",
        "  generator request 3: requested",
        "queue redis://:***@h:1 stream experience: backlog+pending 1, produced 10, trained 8 (+0 awaiting "
        "a checkpoint), dead letters 0"]
    assert status.lines(now=1030.0)[-1].startswith("(as of 30 s ago: the launcher has published nothing since")
    d = json.loads(json.dumps(status.to_json()))
    assert d["generator_stalls"] == 1 and d["learner"]["hangs"] == 1 and d["learner"]["pid"] == 7 and d["generators"][0]["pid"] == 123 and d["gate"] == {"accepted": 16, "running": 8}
    assert d["queue"]["stream"] == "experience" and d["queue"]["lost"] == 0 and d["requests"] == {"3": "requested"}


def test_generator_totals_sum_and_subtract():
    a = GeneratorTotals.of([_gen(), _gen()])
    assert a.tokens == 960 and a.engine_loop_s == 2 * (6.0 + 3.0 + 0.5)
    assert a.minus(GeneratorTotals.of([_gen()])) == GeneratorTotals.of([_gen()])
    assert GeneratorStats.from_json(json.loads(json.dumps(_gen().to_json()))) == _gen()
