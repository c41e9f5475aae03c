"""Helpers shared by test modules (tests/ is on sys.path under pytest): the one trajectory and
group factory of the codec, queue and replay tests, a buggy producer's re-encoding, the
admission gate and a hanging reward of the generator tests, what the learner tests of both
backends share, a TCP proxy to Redis that loses replies, and a Hugging Face cache that holds
a model as the Hub's downloads leave it."""

import collections
import hashlib
import math
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import msgpack
import numpy as np

from async_rlhf.synthetic import random_groups
from async_rlhf.types import Group, Received, Trajectory
from buffer import redis_scripts
from buffer.codec import encode

VOCAB = 256  # the learner tests' tiny model (conftest.py tiny_learner_model)


def hang_reward(prompts, responses):
    """A reward that hangs for good on prompts whose answer is 'hang', 0.5 otherwise (here, so
    that the reward worker processes that import it need not import a test module's torch)."""
    if any(p.answer == "hang" for p in prompts):
        threading.Event().wait()
    return [0.5] * len(prompts)


def make_traj(i: int = 0, **changes) -> Trajectory:
    """Trajectory number i: every field set, most of them different from its neighbours'."""
    fields = dict(
        prompt_ids=np.array([5, 6, 7], dtype=np.int32) + i,
        response_ids=np.array([8, 9, 10, 2**31 - 1], dtype=np.int32),
        behavior_logprobs=np.array([-0.5, -1.25, -3.0e-7, 0.0], dtype=np.float32),
        reward=0.75 + i,
        reward_parts={"correct": 1.0 + i, "length": -0.25},
        policy_version=i % 3,
        generator_id=f"gen-{i % 2}",
        group_id=f"group-{i // 4}",
        finished=bool(i % 2),
        generated_at=1_796_000_000.123456 + i,
        generation_s=0.0625,
    )
    fields.update(changes)
    return Trajectory(**fields)


def make_group(g: int = 0, size: int = 4, **changes) -> Group:
    """Group number g: trajectories g * size ... g * size + size - 1 with group id "group-<g>";
    `changes` apply to every member."""
    return Group(tuple(make_traj(g * size + j, **{"group_id": f"group-{g}", **changes})
                       for j in range(size)))


def reencoded(group: Group, *, member: int | None = None, **edits) -> bytes:
    """encode(group) with map entries replaced (None: removed), as a buggy producer would: in
    the entry's map, or with member=i in that member's map."""
    obj = msgpack.unpackb(encode(group))
    target = obj if member is None else obj["members"][member]
    for key, value in edits.items():
        if value is None:
            del target[key]
        else:
            target[key] = value
    return msgpack.packb(obj, use_bin_type=True)


class EngineGate:
    """The AdmissionGate protocol over StalenessGate, keyed on the engine's weights version (what
    the launcher's gate does through its coordinator)."""

    def __init__(self, gate, version_fn):
        self.gate, self.version_fn = gate, version_fn

    def try_admit(self, n):
        return self.gate.try_admit(n, self.version_fn())

    def finish(self, n_admitted, n_accepted):
        self.gate.finish(n_admitted, n_accepted)


class RecordingPublisher:
    """A WeightPublisher that keeps the last weights and every version published."""

    def __init__(self):
        self.versions, self.weights = [], {}

    def publish(self, named_tensors, version):
        self.weights = {name: t.to("cpu", copy=True) for name, t in named_tensors}  # each valid until the next
        self.versions.append(version)


def check_nonfinite_step_is_skipped(learner, queue, publisher, caplog) -> None:
    """A -inf behaviour log-prob on a real token of the first of two micro-batches (past the
    stream's validation: the loss cannot be computed) skips that optimizer step, changing no
    weight, counted and logged; the next batch from the stream trains, with finite results."""
    import torch

    from learners.batch import Batch

    be = learner.backend
    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(random_groups(2, vocab=VOCAB))])
    batch.behavior_logp[1, 2] = -math.inf
    before = be.full_state_dict()
    stats = learner._train_batch(batch, collections.Counter())
    assert all(torch.equal(before[k], v) for k, v in be.full_state_dict().items())
    assert stats["skipped_nonfinite"] == 1 and learner.counters["skipped_nonfinite"] == 1
    assert math.isnan(stats["grad_norm"]) and math.isnan(stats["loss"])
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "behavior_logp holds 1 NaN/inf" in warning and "policy versions [0]" in warning

    queue.put(random_groups(2, vocab=VOCAB, seed=1))
    metrics = learner.step()
    assert metrics.skipped_nonfinite == 0 and metrics.counts["skipped_nonfinite"] == 1
    assert math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)
    after = publisher.weights
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(bool(torch.isfinite(w).all()) for w in after.values())


class ReplyLosingProxy:
    """A TCP proxy in front of a redis-server that, for every `every`-th put (a call of the put
    script, `redis_scripts.PUT`), forwards the command, lets the server run it, then drops the
    connection instead of passing the reply on: the client cannot tell whether its put ran, and
    retries it. `seen` counts puts (retries included), `lost` the replies dropped."""

    def __init__(self, upstream_url: str, every: int = 3):
        parts = urlsplit(upstream_url)
        self.upstream, self.every = (parts.hostname, parts.port), every
        self.marker = hashlib.sha1(redis_scripts.PUT.encode()).hexdigest().encode()  # its EVALSHA
        self._parts = parts
        self.seen = self.lost = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="proxy").start()

    @property
    def url(self) -> str:
        """The upstream's url (its password included), through the proxy."""
        auth = self._parts.netloc.rpartition("@")[0]
        return urlunsplit(self._parts._replace(netloc=f"{auth + '@' if auth else ''}127.0.0.1:{self.port}"))

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.upstream)
            drop = threading.Event()  # set: the reply now on its way is to be lost
            threading.Thread(target=self._pump, args=(client, server, drop, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, drop, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, drop: threading.Event, requests: bool) -> None:
        try:
            while data := src.recv(65536):
                if requests and self.marker in data:
                    with self._lock:
                        self.seen += 1
                        if self.seen % self.every == 0:
                            drop.set()
                elif not requests and drop.is_set():  # the server ran it: lose its reply
                    with self._lock:
                        self.lost += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):  # shutdown wakes the other direction's recv
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self._listener.close()


def cache_hub_model(hf_home: Path, repo_id: str, model_dir: Path, commit: str = "a" * 40) -> Path:
    """Put `model_dir`'s files into the Hugging Face cache under `hf_home` as Hub id `repo_id`,
    in huggingface_hub's layout (hub/models--org--name/ with refs/main naming the commit,
    blobs/<sha256> and snapshots/<commit>/<file> linking to its blob); returns the snapshot."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
