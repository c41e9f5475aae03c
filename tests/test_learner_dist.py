"""The DeepSpeed learner in separate processes on gloo: data-parallel ranks and kill/resume.

Each test starts real ranks with `python tests/test_learner_dist.py <json>` (the worker at the
bottom of this file), one process per rank on a free loopback port. Rank 0 consumes a fresh
stream on the session's redis-server (its url and the stream name travel in the json) through
the real RedisExperienceQueue and StalenessReplay.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import VOCAB

from async_rlhf.procs import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def start_ranks(spec: dict, ranks: int) -> list[subprocess.Popen]:
    """`ranks` worker processes on one gloo group, meeting under a key as the launcher's ranks do."""
    port, key = free_port(), uuid.uuid4().hex
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT), ASYNC_RLHF_RENDEZVOUS_KEY=key)
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps({**spec, "ranks": ranks})],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def run_ranks(spec: dict, ranks: int, timeout: float = 300) -> list[int]:
    """Run `ranks` worker processes (start_ranks) to their end; their exit codes."""
    procs = start_ranks(spec, ranks)
    codes = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        codes.append(p.returncode)
        if p.returncode not in (0, -signal.SIGKILL):
            print(out.decode()[-4000:])
    return codes


_OUTSIDER = """
import socket, sys, time
from datetime import timedelta
import torch.distributed as dist
port = int(sys.argv[1])
while True:  # until rank 0's store listens
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
    except OSError:
        time.sleep(0.2)
try:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=timedelta(seconds=10))
    print("JOINED")
except Exception as e:
    print("REFUSED", type(e).__name__)
"""


def test_a_process_without_the_rendezvous_key_cannot_take_a_rank():
    """Rank 0's rendezvous store listens on every interface of its node: a process that reaches
    the port and knows torch's plain rendezvous, but not the launcher's key, gets no rank."""
    port = free_port()
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONPATH=str(ROOT), ASYNC_RLHF_RENDEZVOUS_KEY=uuid.uuid4().hex)
    rank0 = subprocess.Popen([sys.executable, "-c", "from learners.deepspeed_backend import init_distributed\n"
                              "print('RANK0', init_distributed('cpu'), flush=True)"],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        outsider = subprocess.run([sys.executable, "-c", _OUTSIDER, str(port)], capture_output=True,
                                  text=True, timeout=180)
        assert "REFUSED" in outsider.stdout, outsider.stdout + outsider.stderr
        assert rank0.poll() is None  # still waiting for the rank that has the key
    finally:
        rank0.kill()
        rank0.communicate()


@pytest.fixture(scope="module")
def one_rank_weights(tiny_learner_model, redis_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-rank")
    spec = dict(mode="train", model=tiny_learner_model, out=str(out), zero_stage=0, redis_url=redis_server.url,
                stream=f"test-{uuid.uuid4().hex[:12]}")
    assert run_ranks(spec, 1) == [0]
    return torch.load(out / "weights.pt"), json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_two_ranks_match_one_rank(tiny_learner_model, one_rank_weights, redis_server, stream_name, tmp_path,
                                  zero_stage):
    """Two ranks train what one does, at ZeRO-0 (the default) as at the partitioned stages. At
    ZeRO-3 the ranks then also load as the backend does on GPU (deepspeed_backend.zero3_init),
    with a reference and a critic: the policy and the critic come out of loading already
    partitioned (each rank holds half of every parameter, none the whole model), the reference
    whole; gathered, the policy is the checkpoint on disk."""
    spec = dict(mode="train", model=tiny_learner_model, out=str(tmp_path), zero_stage=zero_stage,
                redis_url=redis_server.url, stream=stream_name)
    assert run_ranks(spec, 2) == [0, 0]
    for rank in (0, 1) if zero_stage == 3 else ():
        built = json.loads((tmp_path / f"built-{rank}.json").read_text())
        for part in ("policy", "critic"):
            params, partitioned, held, total = built[part]
            assert partitioned == params > 0, (rank, part, built)
            assert total / 2 <= held <= total / 2 + params, (rank, part, built)  # 1/2, padded
        assert built["reference_whole"] and built["policy_equals_disk"], built
    one, one_metrics = one_rank_weights
    two = torch.load(tmp_path / "weights.pt")
    initial = torch.load(tmp_path / "initial.pt")
    assert two.keys() == one.keys()
    moved = max(float((one[k] - initial[k]).abs().max()) for k in two)
    diff = max(float((two[k] - one[k]).abs().max()) for k in two)
    assert moved > 1e-3, "training did not change the weights"
    # Adam moves every weight by ~lr (1e-3) a step whatever its gradient's size, so a weight whose
    # gradient is near Adam's eps carries round-off from the order the ranks' gradients are summed
    # in (ZeRO-3's reduce-scatter: up to 1.6e-5 seen on the tiny preset); a wrong split moves ~lr
    assert diff < 5e-5, (diff, moved)
    # Adam hides a wrong gradient scale in the weights; the loss and grad norm do not
    for a, b in zip(one_metrics, json.loads((tmp_path / "metrics.json").read_text())):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (k, a, b)


def test_two_ranks_match_one_rank_in_dpo(tiny_learner_model, redis_server, tmp_path):
    """Each rank holds one group, so one pair, of the batch: the pair count that normalises the
    loss is the batch's, and the two ranks' update is the one rank's."""
    runs = []
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}"
        out.mkdir()
        spec = dict(mode="train", model=tiny_learner_model, out=str(out), zero_stage=2, algorithm="dpo",
                    redis_url=redis_server.url, stream=f"test-{uuid.uuid4().hex[:12]}")
        assert run_ranks(spec, ranks) == [0] * ranks
        runs.append((torch.load(out / "weights.pt"), json.loads((out / "metrics.json").read_text())))
    (one, one_metrics), (two, two_metrics) = runs
    assert max(float((two[k] - one[k]).abs().max()) for k in two) < 5e-5
    assert one_metrics[-1]["pairs"] == 2 and one_metrics[-1]["reward_margin"] != 0
    # step 1: the policy is the reference, h = 0, and the batch's mean loss is -log sigmoid(0)
    assert one_metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for a, b in zip(one_metrics, two_metrics):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (k, a, b)


def test_checkpoint_kill_resume_keeps_version_and_counters(tiny_learner_model, redis_client, redis_server,
                                                           stream_name, tmp_path):
    from buffer.redis_stream import RedisExperienceQueue

    spec = dict(model=tiny_learner_model, out=str(tmp_path), zero_stage=3, ckpt=str(tmp_path / "ckpt"),
                redis_url=redis_server.url, stream=stream_name)
    stream = RedisExperienceQueue(redis_client, "observer", stream=stream_name)
    # trains v1..v3 (checkpoint after each, the oldest pruned), then is SIGKILLed while
    # publishing v4, before its checkpoint
    assert run_ranks({**spec, "mode": "crash"}, 1) == [-signal.SIGKILL]
    saved = json.loads((tmp_path / "crash.json").read_text())
    assert saved["version"] == 3
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("v*")) == ["v2", "v3"]
    # step 4 trained its batch, then died before its checkpoint: its update is lost, and its
    # groups are not counted trained: held, pending, they wait to be trained again
    stats = stream.stats()
    assert stats.counters == {"produced": 8, "trained": 6} and (stats.pending, stats.held) == (2, 2)  # groups of 4
    assert run_ranks({**spec, "mode": "resume"}, 1) == [0]  # same stream, 8 more groups
    resumed = json.loads((tmp_path / "resume.json").read_text())
    assert resumed["resumed_version"] == 3
    assert resumed["resumed_counters"] == saved["counters"]
    assert resumed["weights_equal_checkpoint"]
    assert resumed["version"] == 4
    assert resumed["counters"]["samples"] == saved["counters"]["samples"] + 8
    assert resumed["counters"]["steps"] == 4
    stats = stream.stats()  # step 4 trained the two groups the crash left (reclaimed at once)
    assert stats.counters == {"produced": 16, "trained": 8, "reclaimed": 2} and stats.backlog == 8


def test_a_rank_that_dies_writing_a_checkpoint_leaves_latest_at_the_one_before(tiny_learner_model, redis_server,
                                                                                stream_name, tmp_path):
    """ZeRO-2 on two ranks, a checkpoint after each step. Rank 1 dies as it starts writing its
    optimizer shard of v2, while rank 0 writes all of its part: `latest` must still name v1,
    the newest checkpoint that every rank finished, or a restart would load a torn one."""
    ckpt = tmp_path / "ckpt"
    rank0, rank1 = start_ranks(dict(mode="torn", model=tiny_learner_model, out=str(tmp_path), zero_stage=2,
                                    ckpt=str(ckpt), redis_url=redis_server.url, stream=stream_name), 2)
    try:
        assert rank1.wait(300) == -signal.SIGKILL, rank1.stdout.read().decode()[-4000:]
        own_part = ckpt / "v2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        deadline = time.monotonic() + 60
        while not own_part.is_file() and rank0.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert own_part.is_file(), "rank 0 did not write its part of v2"
        time.sleep(3.0)  # rank 0 is now in the checkpoint's closing barrier, for ever
        assert (ckpt / "latest").read_text() == "v1"
    finally:
        rank0.kill()
        rank0.wait(60)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_ranks_agree_to_skip_a_step_only_one_rank_found_non_finite(tiny_learner_model, redis_server, stream_name,
                                                                   tmp_path, zero_stage):
    spec = dict(mode="skip", model=tiny_learner_model, out=str(tmp_path), zero_stage=zero_stage,
                redis_url=redis_server.url, stream=stream_name)
    assert run_ranks(spec, 2) == [0, 0]  # neither rank left waiting in a collective
    for rank in (0, 1):  # rank 1 holds the bad token; rank 0 skips because rank 1 does
        report = json.loads((tmp_path / f"skip-{rank}.json").read_text())
        assert report == {"skipped": 1, "count": 1, "unchanged": True, "next_skipped": 0,
                          "next_finite": True, "next_moved": True}, rank


# ---- worker ----------------------------------------------------------------------------------
def _worker(spec: dict) -> None:
    import redis

    from async_rlhf.config import LearnerConfig
    from buffer.redis_stream import RedisExperienceQueue
    from buffer.replay import StalenessReplay
    from learners.deepspeed_backend import DeepSpeedBackend
    from learners.learner import Learner
    from async_rlhf.synthetic import random_groups

    torch.set_num_threads(1)
    out = Path(spec["out"])
    # float32 throughout: the subject is the data-parallel split, whose round-off the weight check
    # bounds; under bf16 autocast Adam amplifies bf16 round-off in near-zero gradients to ~lr
    # (the losses and gradient norms still agree to 1e-6)
    algorithm = spec.get("algorithm", "ppo")  # dpo: a micro-batch holds whole groups (of 4)
    cfg = LearnerConfig(batch_size=8, micro_batch=4 if algorithm == "dpo" else 2, ranks=spec["ranks"],
                        zero_stage=spec["zero_stage"], lr=1e-3, checkpoint_every=1, mixed_precision="fp32",
                        algorithm=algorithm)
    backend = DeepSpeedBackend(cfg, spec["model"])
    rank0 = backend.rank == 0
    mode = spec["mode"]
    class Publisher:
        def publish(self, named, version):
            weights = {k: v.clone() for k, v in named}
            if mode == "crash" and version == 3:
                torch.save(weights, out / "weights_v3.pt")
            if mode == "crash" and version == 4:
                os.kill(os.getpid(), signal.SIGKILL)  # after step 4, before its checkpoint

    start = 3 if mode == "resume" else 0
    groups = [g.with_version(start) for g in random_groups(8, vocab=VOCAB, seed=7 + start)]
    queue = replay = None
    if rank0:  # the only consumer of the stream (see learners/learner.py)
        client = redis.Redis.from_url(spec["redis_url"], decode_responses=False)
        queue = RedisExperienceQueue(client, "learner-0", stream=spec["stream"])
        queue.put(groups)
        replay = StalenessReplay(max_reuse=1, max_staleness=4)
    learner = Learner(cfg, backend, max_staleness=4, group_size=4, queue=queue, replay=replay,
                      publisher=Publisher() if rank0 else None, ckpt_dir=spec.get("ckpt"))
    if mode == "train":
        initial = backend.full_state_dict()
        history = learner.train(steps=2)
        weights = backend.full_state_dict()
        if rank0:
            torch.save(initial, out / "initial.pt")
            torch.save(weights, out / "weights.pt")
            keep = ("loss", "loss_policy", "entropy", "grad_norm", "tokens") + (("bw_mean",) if algorithm == "ppo" else ())
            (out / "metrics.json").write_text(json.dumps([{**{k: getattr(m, k) for k in keep}, **m.extra}
                                                          for m in history]))
        if cfg.zero_stage == 3:
            _report_zero3_loading(backend, spec["model"], out)
    elif mode == "crash":
        learner.train(steps=3)
        (out / "crash.json").write_text(json.dumps({"version": learner.version,
                                                    "counters": dict(learner.counters)}))
        learner.train(steps=1)
    elif mode == "skip":
        _skip_then_train(learner, groups, out)
    elif mode == "torn":
        learner.train(steps=1)
        if not rank0:  # dies as it starts writing its part of the next checkpoint
            write = backend.engine.checkpoint_engine.save

            def save(state, path, *args, **kwargs):
                if f"{os.sep}v2{os.sep}" in str(path):
                    os.kill(os.getpid(), signal.SIGKILL)
                return write(state, path, *args, **kwargs)

            backend.engine.checkpoint_engine.save = save
        learner.train(steps=1)
    else:
        assert learner.resume()
        report = {"resumed_version": learner.version, "resumed_counters": dict(learner.counters)}
        before = backend.full_state_dict()
        saved = torch.load(out / "weights_v3.pt")
        report["weights_equal_checkpoint"] = all(torch.equal(before[k], saved[k]) for k in saved)
        learner.train(steps=1)
        report.update(version=learner.version, counters=dict(learner.counters))
        (out / "resume.json").write_text(json.dumps(report))


def _report_zero3_loading(backend, model_dir: str, out: Path) -> None:
    """Load the policy, a reference and a critic as the backend does on GPU, and report the
    partitions of the policy and the critic, whether the reference is whole, and whether the
    gathered policy is the checkpoint on disk."""
    import dataclasses
    import functools

    import deepspeed
    from safetensors.torch import load_file

    from learners.deepspeed_backend import zero3_init
    from learners.models import load_models

    cfg = dataclasses.replace(backend.cfg, kl_coef=0.1, advantage="gae")
    models = load_models(cfg, model_dir, "cpu", torch.float32,
                         sharded=functools.partial(zero3_init, backend._ds_config()))
    report = {"policy": _partitions(models.policy), "critic": _partitions(models.critic),
              "reference_whole": all(p.numel() > 0 for p in models.reference.parameters())}
    disk = load_file(str(Path(model_dir) / "model.safetensors"))
    params = dict(models.policy.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        report["policy_equals_disk"] = all(torch.equal(params[k].data, disk[k]) for k in disk)
    (out / f"built-{backend.rank}.json").write_text(json.dumps(report))


def _partitions(module) -> tuple[int, int, int, int]:
    """Its parameters; how many are ZeRO-3 partitions (an empty placeholder with a shard); the
    elements this rank holds of them; the elements of the whole."""
    params = list(module.parameters())
    shards = [p for p in params if hasattr(p, "ds_tensor") and p.numel() == 0]
    return len(params), len(shards), sum(p.ds_tensor.numel() for p in shards), sum(p.ds_numel for p in shards)


def _skip_then_train(learner, groups, out: Path) -> None:
    """A batch with a -inf behaviour log-prob in rank 1's rows only (rows 4-7 of 8), straight to
    the training step; then a normal step from the stream. Each rank reports what it saw."""
    import collections

    from async_rlhf.types import Received
    from learners.batch import Batch

    def weights():  # every rank holds full weights under ZeRO 0-2
        return {k: v.clone() for k, v in learner.backend.engine.module.named_parameters()}

    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(groups[:2])])
    batch.behavior_logp[5, 0] = -math.inf
    before = weights()
    stats = learner._train_batch(batch, collections.Counter())
    unchanged = all(torch.equal(before[k], v) for k, v in weights().items())
    metrics = learner.train(steps=1)[0]
    after = weights()
    report = {"skipped": stats["skipped_nonfinite"], "count": learner.counters["skipped_nonfinite"],
              "unchanged": unchanged, "next_skipped": metrics.skipped_nonfinite,
              "next_finite": all(bool(torch.isfinite(w).all()) for w in after.values()),
              "next_moved": any(not torch.equal(before[k], after[k]) for k in before)}
    (out / f"skip-{learner.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
    # leave the gloo group together and tear it down before the interpreter does: left to exit,
    # a rank's gloo threads were destroyed still running (SIGABRT, "terminate called without an
    # active exception"), once in a CI run of the two-rank ZeRO-3 test
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
