"""The job's processes as plain classes; the launcher makes them Ray actors.

- Coordinator: the shared staleness gate, the generator registry, requests from other drivers
  (add-generators, stop). One named actor per job.
- GeneratorWorker: one generator loop (actors.generator) in a thread; its engine is a member of
  the current weight-sync epoch, and the learner's RPC for each update comes here.
- LearnerWorker: one learner rank (learners.learner) and, on rank 0, the weight broadcaster.

Part of the wiring (async_rlhf.launch), the one layer that imports actors/, learners/ and buffer/.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_rlhf.config import Config
from async_rlhf.hub import resolve_model
from async_rlhf.messages import (CoordinatorSnapshot, EvalResult, GeneratorStats, JobSnapshot, StepMetrics,
                                 SyncAddress)
from async_rlhf.procs import (RENDEZVOUS_KEY, WORKER_NICE, free_port, interface_of, lower_priority,
                              threads_of)
from async_rlhf.staleness import StalenessGate, lagged_version

if TYPE_CHECKING:  # torch: the coordinator's process needs none of it
    from async_rlhf.weight_sync import UpdateMeta

log = logging.getLogger(__name__)


SETTLED = ("ready", "refused", "failed")  # what an add-generators request ends as


class Coordinator:
    """Shared state of one job.

    The gate's books have one source: `books.read()` (launch/stream.StreamBooks) gives the
    learner's version and the samples accepted, both from the experience stream in one
    transaction, re-read at every admission and snapshot. Nothing else writes `accepted`: not a
    generator's finish, not the launcher on a learner restart, so no put can be missed between
    two writers, and duplicate or foreign entries (counted by the stream's own scripts) free no
    slot they never held. A generator whose weights are ahead of the learner (a learner that
    restarted from its checkpoint) is admitted as if at the learner's version.

    Generators are known by id and incarnation (a replacement reuses the id with a new
    incarnation). `running` is the one count kept here; `release` of an incarnation is final and
    idempotent: a late `finish` or `try_admit` from a killed incarnation changes nothing."""

    def __init__(self, max_staleness: int, batch_size: int, books):
        self.gate = StalenessGate(max_staleness, batch_size)
        self.books = books
        self.running: Counter[tuple[str, int]] = Counter()
        self.released: set[tuple[str, int]] = set()
        self.requests: list[dict[str, Any]] = []  # add-generators requests not yet taken
        self.placements: dict[int, str] = {}  # request id -> what became of it

    def _learner_version(self) -> int:
        """The learner's version; sets the gate's accepted from the same read."""
        version, self.gate.accepted = self.books.read()
        return version

    def try_admit(self, generator_id: str, incarnation: int, n: int, version: int) -> bool:
        key = (generator_id, incarnation)
        if key in self.released:
            return False
        learner_version = self._learner_version()  # also after a stop request: a learner step
        if not self.gate.try_admit(n, min(version, learner_version)):  # filling its batch needs them
            return False
        self.running[key] += n
        return True

    def finish(self, generator_id: str, incarnation: int, n_admitted: int) -> None:
        """A batch of generation ended (its groups are in the stream, or set aside)."""
        key = (generator_id, incarnation)
        if key in self.released:  # killed: its release freed these already
            return
        if n_admitted > self.running[key]:
            raise ValueError(f"finish({generator_id!r}, {incarnation}, {n_admitted}) with "
                             f"{self.running[key]} running: each batch must be finished once")
        self.gate.ended(n_admitted)
        self.running[key] -= n_admitted

    def release(self, generator_id: str, incarnation: int) -> int:
        """A generator incarnation died: free the samples it had admitted and will never finish
        (at most once; later calls from or about it change nothing)."""
        key = (generator_id, incarnation)
        if key in self.released:
            return 0
        self.released.add(key)
        n = self.running.pop(key, 0)
        self.gate.ended(n)
        return n

    def request_generators(self, count: int, resources: dict[str, float] | None) -> list[int]:
        """Queue `count` generators for the launcher to place; returns their request ids."""
        ids = list(range(len(self.placements), len(self.placements) + count))
        for i in ids:
            self.requests.append({"id": i, "resources": resources or {}})
            self.placements[i] = "requested"
        return ids

    def set_placement(self, request_id: int, state: str) -> None:
        """What became of a request: starting, pending (with why), ready, refused or failed."""
        self.placements[request_id] = state

    def placement(self, request_ids: list[int]) -> dict[int, str]:
        return {i: self.placements[i] for i in request_ids}

    def take_requests(self) -> list[dict[str, Any]]:
        requests, self.requests = self.requests, []
        return requests

    def snapshot(self, job: JobSnapshot) -> CoordinatorSnapshot:
        """The launcher's snapshot with the gate's counts and the unsettled requests."""
        self._learner_version()
        return CoordinatorSnapshot(job, self.gate.accepted, self.gate.running,
                                   {i: state for i, state in self.placements.items()
                                    if not state.startswith(SETTLED)})


class _CoordinatorGate:
    """The AdmissionGate protocol for one generator, backed by the Coordinator actor: one call
    per group as engine slots free (per batch with generator.schedule=lockstep), keyed on the
    version of the weights the group will start with."""

    def __init__(self, coordinator, generator_id: str, incarnation: int, version_fn):
        self.coordinator, self.generator_id, self.version_fn = coordinator, generator_id, version_fn
        self.incarnation = incarnation

    def try_admit(self, n: int) -> bool:
        import ray

        return ray.get(self.coordinator.try_admit.remote(self.generator_id, self.incarnation, n, self.version_fn()))

    def finish(self, n_admitted: int, n_accepted: int) -> None:
        """(n_accepted: already in the stream, which the coordinator reads)"""
        import ray

        ray.get(self.coordinator.finish.remote(self.generator_id, self.incarnation, n_admitted))


class GeneratorWorker:
    """One always-on generator: its engine loop and scorer (actors.generator), and the learner's
    weight updates. The engine (every vLLM worker) is a member of the current weight-sync epoch.
    With generator.weight_updates=inflight and no weight_lag each update goes straight into the
    engine at the engine loop's next safe point, which the learner's broadcast waits for (one
    engine step at most: PipelineRL's pause, receive, resume). Otherwise it is received now and
    kept staged in the engine (in its workers), and an applier loads the version to load (the
    newest, or the lagged one) at the safe point, which may be far off (between_groups waits for
    an empty engine)."""

    def __init__(self, cfg: Config, index: int, redis_url: str, coordinator, incarnation: int):
        from actors.generator import make_generator
        from actors.preferences import make_preference_producer
        from buffer.redis_stream import RedisExperienceQueue

        ray_threads = threads_of()
        self.generator_id = f"gen-{index}"
        queue = RedisExperienceQueue.from_config(cfg.queue, redis_url, consumer=self.generator_id)
        gate = _CoordinatorGate(coordinator, self.generator_id, incarnation, lambda: self.generator.policy_version)
        # data.source=preferences: a producer of the file's pairs takes the generator's place
        make = make_preference_producer if cfg.data.source == "preferences" else make_generator
        self.generator = make(cfg, queue, gate, index=index)
        self.engine = self.generator.engine  # its weight-sync member
        # its start is the job's critical path: generator.nice only once the engine is up
        lower_priority(WORKER_NICE + cfg.generator.nice, since=ray_threads)
        lower_priority(WORKER_NICE)  # Ray's threads
        self.stop_event = threading.Event()
        self.error = ""
        self.last_receive_s = 0.0  # the newest weight update's transfer time
        self.weight_lag = cfg.generator.weight_lag
        self.direct = self.weight_lag == 0 and cfg.generator.weight_updates == "inflight"
        self._staged: set[int] = set()  # versions staged in the engine this epoch
        self._pick: int | None = None  # the staged version the applier is to load next
        self._update_ready = threading.Condition()
        self._threads = [
            threading.Thread(target=self._guard, args=(self.generator.run, self.stop_event),
                             name="generate", daemon=True),
            threading.Thread(target=self._guard, args=(self._apply_updates,), name="apply", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # kept for `status` and the launcher, which stops the job
            self.error = traceback.format_exc()
            log.error("%s: %s", self.generator_id, self.error)

    def sync_ranks(self) -> int:
        return self.engine.sync_ranks

    def join_epoch(self, address: SyncAddress, rank: int) -> None:
        """Join a membership epoch (in the background: the group forms once every member has)."""
        def join() -> None:
            with self._update_ready:
                self._staged.clear()
            self.engine.join_weight_sync(address, rank, node_address())

        _background(join, f"{self.generator_id}: joining weight-sync epoch {address.epoch}")

    def receive_update(self, meta: UpdateMeta) -> None:
        """The learner's RPC: it is broadcasting this update now."""
        start = time.perf_counter()
        if self.direct:
            self._misfit_stops(self.generator.apply_weights, lambda: self.engine.receive_weights(meta, load=True))
        else:
            with self._update_ready:
                keep = set(self._staged)
            self.engine.receive_weights(meta, load=False, keep=keep)
            self._received(meta.version)
        self.last_receive_s = time.perf_counter() - start

    def _misfit_stops(self, fn, *args) -> None:
        """Run `fn`; an update that does not fit the model stops generation at once (nothing
        samples from a half-updated model) and is kept for the launcher, which ends the job."""
        try:
            fn(*args)
        except WeightMismatchError:
            self.stop_event.set()
            self.error = traceback.format_exc()
            log.error("%s: %s", self.generator_id, self.error)
            raise

    def _received(self, version: int) -> None:
        """Hand the applier the staged version to load: the newest, or with generator.weight_lag
        the one staleness.lagged_version picks (older ones are let go)."""
        with self._update_ready:  # keep only the newest pick: a slow load never queues stale ones
            self._staged.add(version)
            # the engine's own version counts: a fresh job's initial weights are never broadcast
            pick = lagged_version([*self._staged, self.engine.policy_version], version, self.weight_lag)
            self._staged = {v for v in self._staged if v >= pick}
            if pick in self._staged and pick != self.engine.policy_version:
                self._pick = pick
                self._update_ready.notify()

    def _apply_updates(self) -> None:
        while not self.stop_event.is_set():
            with self._update_ready:
                self._update_ready.wait_for(lambda: self._pick is not None or self.stop_event.is_set(), 1.0)
                pick, self._pick = self._pick, None
            if pick is not None:  # blocks until the engine loop's safe point: the next step
                self._misfit_stops(self.generator.apply_weights, lambda: self.engine.load_staged(pick))

    def node_address(self) -> str:
        return node_address()

    def stats(self) -> GeneratorStats:
        import ray

        return dataclasses.replace(self.generator.stats(), node=socket.gethostname(), pid=os.getpid(),
                                   node_id=ray.get_runtime_context().get_node_id(),
                                   weight_receive_s=self.last_receive_s, error=self.error)

    def stop(self) -> GeneratorStats:
        self.stop_event.set()
        with self._update_ready:
            self._update_ready.notify_all()
        for t in self._threads:
            t.join(60)
        return self.stats()


def node_address() -> str:
    """This process's node address as Ray reports it: 127.0.0.1 in the job's own loopback
    cluster, the node's own address in a cluster that spans nodes. What a part advertises or
    binds for other parts to reach."""
    import ray

    return ray.util.get_node_ip_address()


def _background(fn, what: str) -> None:
    """Run `fn` in a daemon thread; a failure is logged (a group that does not form is counted
    by the learner, and the launcher forms the next epoch)."""
    def run() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            log.warning("%s failed: %s", what, e)

    threading.Thread(target=run, name=what, daemon=True).start()


class EvalWorker:
    """Held-out evaluation on an engine of its own (actors.evaluate), off every critical path:
    its engine is a member of the weight-sync epochs as a generator's is, receives every version
    staged (the newest and those due are kept) and evaluates versions 0, eval.every,
    2 x eval.every ... in order as their weights arrive; a fresh job's version 0 is the engine's
    initial weights (the model the learner starts from), evaluated at once. Evaluations run one
    at a time; while one runs, due versions wait (at most MAX_WAITING: beyond that the oldest is
    let go and counted in `skipped`). `finish(v)` evaluates the last version too and returns
    what is left to take."""

    MAX_WAITING = 4

    def __init__(self, cfg: Config, fresh: bool):
        from actors.evaluate import make_evaluator

        self.every = cfg.eval.every
        self.evaluator = make_evaluator(cfg)
        self.results: list[EvalResult] = []  # finished, not yet taken
        self.error = ""
        self.skipped = 0
        self.engine = self.evaluator.engine
        lower_priority(WORKER_NICE)  # up (the first weight-sync epoch waits for its engine)
        self._newest: int | None = None  # the newest version received (staged)
        self._due: collections.deque[int | None] = collections.deque([None] if fresh else [])
        self._evaluated = -1  # the version last evaluated
        self._loading: int | None = None  # the due version the loop took, about to load
        self._final = -1
        self._cond = threading.Condition()
        threading.Thread(target=self._loop, name="evaluate", daemon=True).start()

    def sync_ranks(self) -> int:
        return self.engine.sync_ranks

    def join_epoch(self, address: SyncAddress, rank: int) -> None:
        _background(lambda: self.engine.join_weight_sync(address, rank, node_address()),
                    f"evaluator: joining weight-sync epoch {address.epoch}")

    def receive_update(self, meta: UpdateMeta) -> None:
        """The learner's RPC: it is broadcasting this update now; staged, evaluated in turn."""
        with self._cond:
            keep = {v for v in [*self._due, self._loading] if v is not None}
        self.engine.receive_weights(meta, load=False, keep=keep)
        with self._cond:
            self._newest = meta.version
            if meta.version % self.every == 0 or meta.version == self._final:
                self._wait_for(meta.version)

    def _wait_for(self, update: int) -> None:
        if len(self._due) == self.MAX_WAITING:
            self._due.popleft()
            self.skipped += 1
        self._due.append(update)
        self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._due)
                version = self._loading = self._due.popleft()  # None: the initial weights, version 0
            if version is not None and version == self._evaluated:
                continue
            try:
                if version is not None:
                    self.engine.load_staged(version)
                result = self.evaluator.evaluate()
            except Exception:  # noqa: BLE001 - kept for the launcher, which logs it
                self.error = traceback.format_exc()
                log.error("evaluator: %s", self.error)
                result = None
            with self._cond:
                self._evaluated, self._loading = self.engine.policy_version, None
                if result is not None:
                    self.results.append(result)
                self._cond.notify_all()

    def take_results(self) -> list[EvalResult]:
        """Evaluations finished since the last call, oldest first."""
        with self._cond:
            results, self.results = self.results, []
        return results

    def finish(self, version: int, timeout_s: float = 300.0) -> list[EvalResult]:
        """Evaluate `version` (the job's last) once its weights are here, if not done or due
        yet; then take_results()."""
        with self._cond:
            self._final = version
            newest = self._newest
            if newest == version and self._evaluated != version and newest not in self._due:
                self._wait_for(newest)
            if not self._cond.wait_for(lambda: self._evaluated == version, timeout_s):
                log.warning("evaluator: version %d not evaluated within %.0f s", version, timeout_s)
        return self.take_results()


class LearnerWorker:
    """One learner rank. Rank 0 consumes the stream, owns the replay buffer and broadcasts."""

    def __init__(self, cfg: Config, rank: int, redis_url: str, resume: bool):
        """Light: `start` builds the rank, once rank 0's `master_address` is known."""
        self.cfg, self.rank, self.redis_url, self.resume = cfg, rank, redis_url, resume
        self.out = Path(cfg.out)
        self._busy = threading.Lock()  # step and finish never overlap

    def master_address(self) -> tuple[str, int, str]:
        """Rank 0: where the ranks meet, on rank 0's own node (a free port there), and the
        secret their rendezvous keys live under (procs.RENDEZVOUS_KEY)."""
        host = node_address()
        return host, free_port(host), secrets.token_hex(16)

    def start(self, master: tuple[str, int, str]) -> str:
        """Join the ranks at `master` and load the model (resumed from the newest checkpoint,
        or the initial weights if there is none); rank 0 also opens the weight broadcaster on
        its node's address. Returns this rank's node address."""
        from actors.engines import weights_dtype
        from async_rlhf.weight_sync import WeightBroadcaster

        lower_priority(WORKER_NICE)  # the engines start first (procs.STARTUP_NICE)
        cfg, rank = self.cfg, self.rank
        host, port, key = master
        here = node_address()
        # gloo's ranks connect over the interface of this node's own address (ranks can span
        # nodes; the hostname may resolve to loopback)
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(cfg.learner.ranks),
                          MASTER_ADDR=host, MASTER_PORT=str(port), **{RENDEZVOUS_KEY: key},
                          GLOO_SOCKET_IFNAME=interface_of(here))
        import torch

        from buffer.redis_stream import RedisExperienceQueue
        from buffer.replay import StalenessReplay
        from learners.backends import make_backend
        from learners.learner import Learner

        torch.set_num_threads(cfg.learner.threads)
        backend = make_backend(cfg.learner, cfg.model.path, dtype=cfg.model.dtype,
                               temperature=cfg.generator.temperature, seed=cfg.seed)
        # the generators' weight dtype: the job's generators are on GPUs where its learner is
        wire = weights_dtype(cfg.generator, "cuda" if torch.cuda.is_available() else "cpu", cfg.model.dtype)
        passing = "ipc" if cfg.placement == "colocated" else None  # shared memory on this node; else a broadcast
        self.broadcaster = WeightBroadcaster(host=here, backend=passing, timeout_s=60, dtype=wire) if rank == 0 else None
        self.learner = Learner(
            cfg.learner, backend, max_staleness=cfg.max_staleness, group_size=cfg.generator.group_size,
            queue=RedisExperienceQueue.from_config(cfg.queue, self.redis_url, consumer=f"learner-{rank}")
            if rank == 0 else None,
            replay=StalenessReplay(max_reuse=cfg.learner.max_reuse, max_staleness=cfg.max_staleness)
            if rank == 0 else None,
            publisher=self.broadcaster,
            ckpt_dir=self.out / "checkpoints",
            response_limit=cfg.response_limit,
            completions=self._completions() if rank == 0 and cfg.log.completions_every else None,
        )
        if self.resume:
            self.learner.resume()
            self.learner.publish_weights()  # kept by the broadcaster for the first epoch
        return here

    def _completions(self):
        """(a batch's groups, the version they make) -> log.completions_groups of them decoded
        with the model's tokenizer, every log.completions_every versions; () between."""
        from transformers import AutoTokenizer

        from learners.samples import completion_groups

        log = self.cfg.log
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.cfg.model.path))

        def completions(items, version: int) -> tuple:
            if version % log.completions_every:
                return ()
            return completion_groups(items, step=version, groups=log.completions_groups,
                                     advantage=self.cfg.learner.advantage, decode=tokenizer.decode)
        return completions

    def get_version(self) -> int:
        return self.learner.version

    def pid(self) -> int:
        return os.getpid()

    def keep_waiting(self) -> None:
        """No generator is alive (one is being replaced): the wait for data does not count
        towards learner.wait_s. Runs beside a step (a threaded actor)."""
        self.learner.keep_waiting()

    def give_up_waiting(self) -> None:
        """The job ends with an error: a step in flight waiting for data stops waiting. Runs
        beside a step (a threaded actor)."""
        self.learner.give_up_waiting()

    def open_epoch(self, members: list, world_size: int) -> SyncAddress:
        """A new weight-sync epoch of `members` (actor handles with receive_update) holding
        world_size - 1 ranks. Called while a step may be running (a threaded actor): touches only
        the broadcaster. Each update's RPC to the members carries its metadata; its wait ends
        when every member has taken the update, and raises if one failed or died."""
        import ray

        timeout_s = self.broadcaster.timeout_s

        def notify(meta: UpdateMeta):
            refs = [member.receive_update.remote(meta) for member in members]
            return lambda: ray.get(refs, timeout=timeout_s)

        return self.broadcaster.open_epoch(world_size, notify)

    def step(self) -> StepMetrics:
        with self._busy:
            metrics = self.learner.step()
        if self.broadcaster is not None:
            metrics = dataclasses.replace(metrics, weight_sync_s=self.broadcaster.last_publish_s,
                                          weight_sync_bytes=self.broadcaster.last_publish_bytes,
                                          weight_sync_failures=self.broadcaster.failures)
        return metrics

    def finish(self) -> str:
        """Checkpoint and export the policy (all ranks call it); returns the export directory.
        Waits for a step in flight: the actor is threaded (for open_epoch), these two are not."""
        with self._busy:
            self.learner.save_checkpoint()
            export = self.out / "policy"
            self.learner.backend.save_pretrained(export)
            if self.rank == 0:  # with its tokenizer: the directory loads as the model it came from
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(resolve_model(self.cfg.model.path)).save_pretrained(export)
            if self.broadcaster is not None:
                self.broadcaster.close()
            return str(export)
