"""`async-rlhf train`: one command runs the whole job.

    model (built if absent) -> Redis (embedded unless queue.redis_url) -> Ray (local unless
    --ray-address) -> coordinator, learner ranks, generators -> weight-sync epoch -> steps

Start-up runs its parts side by side (the Ray head while the model and Redis get ready; the
learner ranks and the generators together) and prints where the time went. The driver loop
calls one learner step at a time and, while it runs, watches the job each second: a dead
generator is released from the gate and replaced (generator.max_restarts), a dead learner rank
restarts every rank from the newest checkpoint (learner.max_restarts; in the final checkpoint
and export too, which then run again), a dead embedded redis-server is restarted (launch/stream.py;
the gate's books are read from the stream, never written here); requests from other drivers
(`add-generators`, `stop`) are taken; a status snapshot is published. Every step writes a
StepRecord (launch/metrics.py) to OUT/metrics.jsonl, TensorBoard and the console; the end writes
OUT/summary.json, a JobSummary with the accounting of every group (async_rlhf/messages.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import socket
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from async_rlhf.config import Config, ConfigError, redact_url
from async_rlhf.launch import cluster, groups
from async_rlhf.launch.cli import add_config_arguments, config_from_args
from async_rlhf.launch.metrics import MetricsLog, StepRecord
from async_rlhf.launch.placement import part_resources
from async_rlhf.launch.memory import out_of_memory
from async_rlhf.launch.preflight import preflight
from async_rlhf.launch.stall import StallWatch
from async_rlhf.launch.stream import JobStream
from async_rlhf.messages import (EvalResult, GeneratorStats, JobSnapshot, JobStatus, JobSummary, LearnerStatus,
                                 StepMetrics)
from async_rlhf.procs import LOOPBACK, stop_on_signals

log = logging.getLogger("async_rlhf")

TICK_S = 1.0
RANK_PING_S = 30.0  # the most a learner rank may take to answer whether it lives


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
    parser.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    prompt_chars = preflight(cfg)  # what the config names is there and reads, before anything starts
    return Job(cfg, ray_address=args.ray_address, resume=args.resume, prompt_chars=prompt_chars).run()


class Job:
    def __init__(self, cfg: Config, ray_address: str | None = None, resume: bool = False,
                 prompt_chars: int | None = None):
        self.cfg, self.ray_address, self.resume = cfg, ray_address, resume
        self.prompt_chars = prompt_chars  # the longest prompt (preflight), for the memory estimate
        self.sizes = None  # what the memory estimate reads (launch/memory.py), once run() starts
        self.out = Path(cfg.out)
        self.generators: dict[str, Any] = {}  # generator id -> actor handle
        self.next_index = 0
        self.incarnations: dict[str, int] = {}  # generator id -> its live (or last) incarnation
        self.gen_stats: dict[str, GeneratorStats] = {}  # as of the last tick
        self.last_tick = 0.0
        self.starting: dict[str, tuple[Any, Any]] = {}  # generator id -> (handle, ready ref)
        self.placement: dict[str, dict[str, float]] = {}  # generator id -> Ray resources asked
        self.groups: dict[str, Any] = {}  # "learner" or a generator id -> its placement group
        self.restarts = 0  # generators replaced so far (generator.max_restarts at most)
        self.stall_watch = StallWatch(cfg.generator.stall_s)
        self.stalls = 0  # generators lost for making no progress (generator.stall_s)
        self.learner_restarts = 0  # learner.max_restarts at most
        self.learner_hangs = 0  # of them, hung: a step or the final checkpoint past its timeout
        self.learner_pid = 0
        self.due_restarts: list[tuple[float, str]] = []  # (monotonic time, generator id)
        self.requested: dict[str, tuple[int, dict, float]] = {}  # gid -> (request, need, since)
        self.sync_failures = 0
        self.last_metrics: StepMetrics | None = None
        self.error = ""
        self.start_time = time.time()
        self.ray = None  # set once connected; the parts below exist once they have started
        self.cluster = None  # the local Ray head, unless --ray-address
        self.redis_url = ""
        self.start_version = 0  # the learner's version when the job (re)started
        self.coordinator = None
        self.stream: JobStream | None = None
        self.learners: list[Any] = []
        self.step_in_flight: tuple[list, float] | None = None  # the ranks' step refs, its start
        self.learner_starts: list[Any] = []  # the ranks' start calls (refs)
        self.finishing: list[Any] = []  # the ranks' final checkpoint and export calls (refs)
        self.export = ""  # the policy's directory, once they are done
        self.stopping = 0.0  # monotonic time the end began: the final checkpoint, or after the loop
        self.evaluator = None  # the EvalWorker actor when eval.every > 0
        self.metrics: MetricsLog | None = None  # opened once the generators are up
        self.startup: dict[str, float] = {}  # phase -> seconds since the command started
        self.placement_line = ""  # what placement: auto chose, and why
        self.summary: JobSummary | None = None  # summary.json: written at the end, then with shutdown_s

    def _mark(self, phase: str) -> None:
        from async_rlhf.procs import process_age_s

        self.startup[phase] = round(process_age_s(), 1)

    # -- setup and teardown ----------------------------------------------------------------
    def run(self) -> int:
        from async_rlhf.devices import bf16_native
        from async_rlhf.launch.memory import ModelShape, Sizes, host_memory
        from async_rlhf.launch.placement import apply_placement
        from async_rlhf.procs import process_age_s

        gpus = _gpu_count()
        devices = gpus or len(os.sched_getaffinity(0))
        # every part on this node (the job's own Ray head): what it can give must hold them
        local = self.ray_address is None
        self.sizes = Sizes(ModelShape.of(self.cfg), bf16_native("cuda" if gpus else "cpu"), self.prompt_chars)
        self.cfg, self.placement_line = apply_placement(self.cfg, devices, gpu=gpus > 0, one_node=local,
                                                        memory=host_memory() if local else None, sizes=self.sizes)
        cfg = self.cfg
        if cfg.placement == "colocated" and not local:
            raise ConfigError("placement: colocated runs every part on this node and passes the weights "
                              "through its shared memory, so it cannot join a Ray cluster (--ray-address): "
                              "set placement: auto or manual")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(cfg.to_yaml())
        print(f"async-rlhf: job {cfg.job!r}, max_staleness={cfg.max_staleness}, out={self.out}")
        if self.placement_line:
            print(self.placement_line, flush=True)
        self.start_time = time.time() - process_age_s()  # times are the user's: since the command
        with ExitStack() as stack:
            try:  # a part that cannot start ends the job at once, with its cause and a summary
                self._start_services(stack)
                self._start_actors()
                code = self._loop()
            except KeyboardInterrupt:
                print("\ninterrupted: checkpointing the learner, stopping generators", file=sys.stderr)
                self._record_step_in_flight()
                code = 130
            except Exception as e:  # noqa: BLE001 - still stop cleanly and account for everything
                self.error = out_of_memory(str(e), cfg, self.sizes) or f"{type(e).__name__}: {e}".strip()
                log.error("job failed: %s", self.error)
                code = 1
            self.stopping = self.stopping or time.monotonic()
            self._finish()
        shutdown_s = round(time.monotonic() - self.stopping, 1)
        self.summary = dataclasses.replace(self.summary, shutdown_s=shutdown_s)
        self._write_summary()
        print(f"shut down in {self.summary.shutdown_s:.1f} s (checkpoint, export, generators, Ray, Redis)")
        return code

    def _write_summary(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.summary.to_json(), indent=2, default=float))

    def _start_services(self, stack: ExitStack) -> None:
        """The model directory, Redis (embedded unless queue.redis_url) and the experience
        stream, while the Ray head starts (it takes longest); then connect to Ray. Joining a
        cluster (--ray-address), Ray comes first: Redis binds the address Ray reports for this
        node, which the other nodes reach."""
        from actors.model_init import ensure_model
        from buffer.redis_server import EmbeddedRedis

        cfg = self.cfg
        self._launch_head()
        stack.callback(self._shutdown_ray)
        if self.ray_address:
            self._connect_ray()
        ensure_model(cfg.model.path, cfg.model.preset, seed=cfg.seed, tokenizer=cfg.model.tokenizer)
        self._mark("model")
        host = self.ray.util.get_node_ip_address() if self.ray else LOOPBACK
        server = None  # the embedded redis-server, unless queue.redis_url
        if not cfg.queue.redis_url:
            server = stack.enter_context(EmbeddedRedis(self.out / "redis", host=host, durable=cfg.queue.durable))
        self.redis_url = cfg.queue.redis_url or server.url
        self.stream = JobStream(cfg, self.redis_url, server)
        self.stream.check_fresh(self.resume)
        self._mark("redis")
        if self.cluster is not None:
            self.cluster.wait_ready()
            self._connect_ray()
        self._mark("ray")
        address = self.ray_address or self.cluster.address
        cluster.write_job_info(self.cfg.job, {
            "ray_address": address,
            "ray_token_path": None if self.cluster is None else str(self.cluster.token_path),
            "redis_url": self.redis_url, "out": str(self.out.resolve()), "namespace": self.cfg.job,
            "pid": os.getpid(), "host": socket.gethostname(), "node_address": host,
        })
        where = ("loopback: the job's own single-node Ray cluster" if self.cluster is not None
                 else f"this node's address in the Ray cluster at {address}")
        print(f"network: Redis at {host} ({where}); the learner and the weight sync listen on their "
              "own nodes' addresses", flush=True)
        if server is not None:
            print("stream: durable (append-only file, fsync every second)" if cfg.queue.durable else
                  "stream: in memory only (queue.durable=false): a redis-server death ends the job; "
                  "queue.durable=true survives it for ~15% of the stream's put rate", flush=True)
        stop_on_signals()  # after ray.init, which sets its own

    def _launch_head(self) -> None:
        """Start a local Ray head for this job, without waiting for it (none with --ray-address)."""
        if self.ray_address:
            return
        learner, gen = self.cfg.learner, self.cfg.generator
        needed = learner.ranks * learner.threads + gen.count * gen.threads + bool(self.cfg.eval.every)
        # room for `add-generators` on this machine too (the OS shares the cores)
        self.cluster = cluster.launch_local_cluster(num_cpus=needed + (os.cpu_count() or 1))

    def _connect_ray(self) -> None:
        import ray

        token_path = None if self.cluster is None else str(self.cluster.token_path)
        cluster.connect(self.ray_address or self.cluster.address, namespace=self.cfg.job,
                        token_path=token_path)
        self.ray = ray

    def _shutdown_ray(self) -> None:
        cluster.remove_job_info(self.cfg.job)
        if self.ray is not None:
            self.ray.shutdown()
        if self.cluster is not None:
            self.cluster.stop()

    def _start_actors(self) -> None:
        """The coordinator, the generators, then the learner ranks, so that DeepSpeed and vLLM
        start side by side; the gate starts at the version the learner resumes from. Ray starts
        as many worker processes at once as the machine has cores, in the order asked for: the
        generators' engine start, the job's critical path, goes first."""
        from async_rlhf.launch.roles import Coordinator
        from async_rlhf.launch.stream import StreamBooks
        from learners.checkpoints import checkpoint_version

        cfg = self.cfg
        self.start_version = checkpoint_version(self.out / "checkpoints") if self.resume else 0
        books = StreamBooks(cfg.queue, self.redis_url, cfg.learner.batch_size, cfg.generator.group_size)
        self.coordinator = self.ray.remote(Coordinator).options(name="coordinator").remote(
            cfg.max_staleness, cfg.learner.batch_size, books)
        for _ in range(cfg.generator.count):
            self._add_generator(dict(cfg.generator.resources))
        self._start_learners(self.resume)
        if cfg.eval.every:
            from async_rlhf.launch.roles import EvalWorker

            need = part_resources(cfg, gpu=bool(_gpu_count()))["evaluator"]  # on GPU, GPUs of its own (or a share)
            self.evaluator = self.ray.remote(EvalWorker).options(
                num_cpus=need["CPU"], num_gpus=need.get("GPU", 0), max_concurrency=4,
                name="evaluator").remote(cfg, fresh=not self.resume)
        version = self._learners_ready()
        if version != self.start_version:
            raise RuntimeError(f"the learner resumed at version {version}, but the checkpoint "
                               f"directory's newest tag says {self.start_version}")
        self._mark("learner")

    def _start_learners(self, resume: bool) -> None:
        """Start the learner ranks (from the newest checkpoint when `resume`), meeting at rank
        0's node address, without waiting for them (Ray passes them rank 0's answer)."""
        from async_rlhf.launch.roles import LearnerWorker

        ray, cfg = self.ray, self.cfg
        bundle = part_resources(cfg, gpu=bool(_gpu_count()))["learner"]  # a rank's
        if "learner" not in self.groups:  # kept for restarts (groups.py)
            self.groups["learner"] = groups.reserve(ray, [bundle] * cfg.learner.ranks,
                                                    "PACK" if "GPU" in bundle else "SPREAD",
                                                    "learner", wait_s=groups.LEARNER_WAIT_S)
        worker = ray.remote(LearnerWorker)
        # max_concurrency 2: open_epoch runs while a step waits for the samples it will bring
        self.learners = [worker.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=2,
                                        **groups.in_bundle(self.groups["learner"], rank)).remote(
            cfg, rank, self.redis_url, resume) for rank in range(cfg.learner.ranks)]
        master = self.learners[0].master_address.remote()
        self.learner_starts = [learner.start.remote(master) for learner in self.learners]

    def _learners_ready(self) -> int:
        """Wait for the learner ranks to be up; their version. If one fails to start, every rank
        is killed: a rank that did start would wait for the others in the final checkpoint, and
        that checkpoint must not replace the one the failed rank could not load."""
        try:
            nodes = self.ray.get(self.learner_starts)
        except Exception:
            for learner in self.learners:
                self.ray.kill(learner)
            self.learners = []
            raise
        print(f"learner ready: {len(nodes)} rank(s) on {', '.join(nodes)}", flush=True)
        self.learner_pid = self.ray.get(self.learners[0].pid.remote())
        return self.ray.get(self.learners[0].get_version.remote())

    def _restart_learners(self, why: str) -> int:
        """A learner rank died or hung: restart every rank from the newest checkpoint (ranks train in
        lock-step, so they go back together; rank 0 records its version in the stream, which the
        gate reads), and form a new weight-sync epoch, whose first message brings the generators
        back to that version. Returns the learner's version."""
        ray, budget = self.ray, self.cfg.learner.max_restarts
        if report := out_of_memory(why, self.cfg, self.sizes):  # a restart would be killed the same way
            raise RuntimeError(report)
        if self.learner_restarts >= budget:  # dead or hung, they cannot write a final checkpoint
            for learner in self.learners:
                ray.kill(learner)
            self.learners = []
            raise RuntimeError(f"the learner failed ({why}) and learner.max_restarts={budget} "
                               "restarts are spent")
        self.learner_restarts += 1
        self.step_in_flight, self.finishing = None, []  # lost with the ranks
        self.stopping = 0.0  # the end begins again after the steps the checkpoint lacks
        print(f"learner failed ({why}); restarting it from the newest checkpoint (restart "
              f"{self.learner_restarts} of learner.max_restarts={budget})", file=sys.stderr)
        for learner in self.learners:
            ray.kill(learner)
        self._start_learners(resume=True)
        version = self._learners_ready()
        self.sync_failures = 0  # the new broadcaster counts its own
        self._new_epoch()
        print(f"learner restarted at version {version}", file=sys.stderr)
        return version

    def _add_generator(self, resources: dict[str, float], index: int | None = None) -> str:
        """Start generator number `index` (default: a new one) with its own prompt stream;
        returns its id."""
        from async_rlhf.launch.roles import GeneratorWorker

        if index is None:
            index, self.next_index = self.next_index, self.next_index + 1
        gid = f"gen-{index}"
        self.incarnations[gid] = incarnation = self.incarnations.get(gid, -1) + 1
        self.placement[gid] = resources
        need = self._generator_needs(resources)
        if gid not in self.groups:  # a replacement takes the bundle of the one it replaces
            self.groups[gid] = groups.reserve(self.ray, [need], "STRICT_PACK", gid)
        handle = self.ray.remote(GeneratorWorker).options(
            num_cpus=need.pop("CPU"), num_gpus=need.pop("GPU", 0), resources=need, max_concurrency=4,
            name=gid, **groups.in_bundle(self.groups[gid])).remote(self.cfg, index, self.redis_url, self.coordinator,
                                                                 incarnation)
        self.starting[gid] = (handle, handle.__ray_ready__.remote())
        print(f"generator {gid} starting{' on ' + json.dumps(resources) if resources else ''}")
        return gid

    def _generator_needs(self, resources: dict[str, float]) -> dict[str, float]:
        """The Ray resources one generator takes: its threads, its engine's GPUs, `resources`."""
        return {**part_resources(self.cfg, gpu=bool(_gpu_count()))["generator"],
                **{k: float(v) for k, v in resources.items()}}

    def _place(self, request_id: int, resources: dict[str, float]) -> None:
        """An add-generators request: start it if some node could ever host it, else refuse it
        at once, naming what it asked for and what the nodes have."""
        need = self._generator_needs(resources)
        nodes = [n["Resources"] for n in self.ray.nodes() if n["Alive"]]
        if self.cfg.placement == "colocated":
            state = ("refused: placement: colocated passes the weights through this node's shared memory, "
                     "so its generators stay as started; add generators to a job with placement: auto or manual")
            print(f"generator request {request_id} {state}", file=sys.stderr)
        elif not any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
            state = (f"refused: no node has {need}; the nodes have {nodes} (start one with those "
                     "resources: `ray start --address=... --resources=...`)")
            print(f"generator request {request_id} {state}", file=sys.stderr)
        else:
            gid = self._add_generator(resources)
            self.requested[gid] = (request_id, need, time.monotonic())
            state = f"starting {gid}"
        self.ray.get(self.coordinator.set_placement.remote(request_id, state))

    def _report_pending(self) -> None:
        """Requested generators that Ray has not placed after a few seconds: say why."""
        for gid, (request_id, need, since) in self.requested.items():
            if gid in self.starting and time.monotonic() - since > 5.0:
                free = {k: v for k, v in self.ray.available_resources().items() if "memory" not in k}
                self.coordinator.set_placement.remote(
                    request_id, f"pending {gid}: waiting for {need} (free now: {free})")

    def _wait_for_generators(self, timeout_s: float = 0.0) -> None:
        """Move generators whose engine is up into the job (they join the next epoch); report
        those whose start failed. A generator that cannot be placed yet stays pending."""
        ray = self.ray
        refs = {ref: gid for gid, (_, ref) in self.starting.items()}
        ready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)[0] if refs else []
        for ref in ready:
            gid = refs[ref]
            handle, _ = self.starting.pop(gid)
            request_id = self.requested.pop(gid, (None,))[0]
            try:
                ray.get(ref)
                node = ray.get(handle.node_address.remote())
            except ray.exceptions.RayError as e:
                print(f"generator {gid} failed to start: {e}", file=sys.stderr)
                groups.release(self.groups.pop(gid))
                if request_id is not None:
                    ray.get(self.coordinator.set_placement.remote(request_id, f"failed {gid}: {e}"))
                continue
            self.generators[gid] = handle
            if request_id is not None:
                ray.get(self.coordinator.set_placement.remote(request_id, f"ready {gid}"))
            print(f"generator {gid} ready on {node}")
        if not self.generators and not self.starting and not self.due_restarts:
            raise RuntimeError("no generator is running: none could start, or every one died with "
                               "generator.max_restarts spent (see the errors above)")

    def _new_epoch(self) -> None:
        """Form a weight-sync group of the learner and the live generators' engines (every vLLM
        worker is a rank). It forms in the background, also during a learner step, and starts
        by sending the newest weights."""
        ray = self.ray
        gens = list(self.generators.items())
        if self.evaluator is not None:  # it follows the weights as a generator does
            gens.append(("evaluator", self.evaluator))
        sizes = self._from_live(gens, [h.sync_ranks.remote() for _, h in gens])
        if sizes is None:
            return self._new_epoch()  # without those that died
        address = ray.get(self.learners[0].open_epoch.remote([h for _, h in gens], 1 + sum(sizes)))
        firsts = [1 + sum(sizes[:i]) for i in range(len(gens))]
        if self._from_live(gens, [h.join_epoch.remote(address, r) for (_, h), r in zip(gens, firsts)]) is None:
            return self._new_epoch()
        log.info("weight-sync epoch %d at %s:%d: learner + %s", address.epoch, address.host, address.port,
                 [g for g, _ in gens])

    def _from_live(self, gens: list, refs: list) -> list | None:
        """The calls' results, or None after losing the generators that died since the last tick
        saw them alive."""
        results, dead = [], []
        for (gid, _), ref in zip(gens, refs):
            try:
                results.append(self.ray.get(ref))
            except self.ray.exceptions.RayActorError as e:
                if gid not in self.generators:
                    raise  # the evaluator
                dead.append((gid, type(e).__name__))
        for gid, why in dead:
            self._lose_generator(gid, why)
        return None if dead else results

    # -- the loop --------------------------------------------------------------------------
    def _loop(self) -> int:
        ray, cfg = self.ray, self.cfg
        self._wait_for_generators(timeout_s=600)  # first engines up (model load, vLLM start)
        if self.evaluator is not None:
            ray.get(self.evaluator.__ray_ready__.remote(), timeout=600)
        self._mark("generators")
        self.metrics = MetricsLog(self.out, cfg.learner.steps, wandb=self._wandb())
        version = self.start_version
        self._new_epoch()
        while True:
            step_start = time.perf_counter()
            try:
                if version >= cfg.learner.steps:
                    self.export = self._final_checkpoint()
                    break
                metrics = self._step()
            except _RankDied as e:  # (a task error still ends the job)
                version = self._restart_learners(str(e))
                continue
            version = metrics.version
            reason = cluster.stop_request(cfg.job)
            self._record(metrics, time.perf_counter() - step_start,
                         last=bool(reason) or version >= cfg.learner.steps)
            if reason:
                print(f"stopping: {reason}")
                break
        return 0

    def _wandb(self):
        """The job's W&B run with log.wandb.project, else None (and wandb is never imported)."""
        if not self.cfg.log.wandb.project:
            return None
        from async_rlhf.launch.trackers import WandbRun

        return WandbRun(self.cfg, self.out)

    def _step(self) -> StepMetrics:
        """One learner step on every rank, watching the job each second while it runs. A step
        past learner.step_timeout_s has a hung rank: raise _RankDied, which restarts them all."""
        ray, timeout_s = self.ray, self.cfg.learner.step_timeout_s
        refs = [l.step.remote() for l in self.learners]
        self.step_in_flight = (refs, time.perf_counter())
        deadline = time.monotonic() + timeout_s
        while len(ready := ray.wait(refs, num_returns=len(refs), timeout=TICK_S)[0]) < len(refs):
            self._rank_results(ready)  # a rank that failed: raise now, not after the others' timeout
            if time.monotonic() > deadline:
                self.learner_hangs += 1
                hung = [rank for rank, ref in enumerate(refs) if ref not in ready]
                raise _RankDied(f"the step ran past learner.step_timeout_s={timeout_s:g} on ranks {hung}")
            self._tick()
        if time.monotonic() - self.last_tick >= TICK_S:  # fast steps: still watch each second
            self._tick()
        return self._rank_results(refs)[0]  # in flight until its row is written (_record)

    def _final_checkpoint(self) -> str:
        """The ranks' final checkpoint and policy export; its directory. A rank that dies in it,
        or hangs (it runs past learner.step_timeout_s, which bounds a step's checkpoints too),
        raises _RankDied, as in a step."""
        timeout_s = self.cfg.learner.step_timeout_s
        self.stopping = time.monotonic()
        self.finishing = [l.finish.remote() for l in self.learners]
        try:
            return self._rank_results(self.finishing, timeout=timeout_s)[0]
        except self.ray.exceptions.GetTimeoutError:
            self.learner_hangs += 1
            raise _RankDied(f"the final checkpoint ran past learner.step_timeout_s={timeout_s:g}") from None

    def _record_step_in_flight(self) -> None:
        """Interrupted during a learner step or before its row was written: the ranks finish it
        and the final checkpoint holds it, so its row goes into metrics.jsonl too (a resumed job's
        rows then have no gap)."""
        if self.step_in_flight is None or self.metrics is None:
            return
        (refs, start), self.step_in_flight = self.step_in_flight, None
        try:
            metrics = self.ray.get(refs)[0]
        except Exception as e:  # noqa: BLE001 - e.g. a rank died: the checkpoint says where it stands
            log.warning("the learner step in flight at the interrupt failed: %s", e)
            return
        if metrics.version > self.metrics.last_version:  # not written before the interrupt
            self._record(metrics, time.perf_counter() - start)

    def _rank_results(self, refs: list, timeout: float | None = None) -> list:
        """The ranks' results (waiting at most `timeout`); a rank's death raises _RankDied (only
        theirs: an actor error from anything else the tick calls is no reason to restart the
        learner). When one rank dies, another's collective with it may fail first, as that rank's
        task error (gloo: "Connection reset by peer"): then a rank found dead is the cause, and
        the error ends the job only when every rank lives."""
        ray = self.ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayActorError as e:
            raise _RankDied(type(e).__name__) from e
        except ray.exceptions.RayTaskError as e:
            dead = self._dead_ranks()
            if dead:
                raise _RankDied(f"rank {dead[0]} died; the step of another failed with it: "
                                f"{str(e).strip().splitlines()[-1][:200]}") from e
            raise

    def _dead_ranks(self) -> list[int]:
        """The learner ranks whose actor is dead: each is asked for its pid (a rank whose death
        Ray has not noticed yet fails the call when it does)."""
        ray, dead = self.ray, []
        pings = [learner.pid.remote() for learner in self.learners]
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=RANK_PING_S)
            except ray.exceptions.RayActorError:
                dead.append(rank)
            except ray.exceptions.GetTimeoutError:  # alive, busy: not known dead
                pass
        return dead

    def _tick(self) -> None:
        """While a step runs: watch generators, take requests, publish the status snapshot."""
        ray = self.ray
        self.last_tick = time.monotonic()
        self.stream.refresh()  # first: the job's own redis-server, if it died, is restarted there
        members = set(self.generators)
        for request in ray.get(self.coordinator.take_requests.remote()):
            self._place(request["id"], request["resources"])
        self._report_pending()
        while self.due_restarts and self.due_restarts[0][0] <= time.monotonic():
            gid = self.due_restarts.pop(0)[1]
            try:
                self._add_generator(self.placement[gid], index=int(gid.split("-")[1]))
            except ValueError:  # Ray has not released the dead actor's name yet
                self.due_restarts.append((time.monotonic() + 1.0, gid))
        self._wait_for_generators()
        refs = {gid: h.stats.remote() for gid, h in self.generators.items()}
        for gid, ref in refs.items():
            try:
                self.gen_stats[gid] = ray.get(ref, timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self._lose_generator(gid, f"{type(e).__name__}")
                continue
            stats = self.gen_stats[gid]
            if stats.error:
                log.error("generator %s failed:\n%s", gid, stats.error)
                if "WeightMismatchError" in stats.error:  # a replacement would fail the same way
                    raise RuntimeError(f"generator {gid}: {stats.error.strip().splitlines()[-1]}")
                self._lose_generator(gid, stats.error.strip().splitlines()[-1])
            elif why := self.stall_watch.stalled(gid, stats.steps + stats.weight_updates, stats.sequences,
                                                 stats.updates_waiting, time.monotonic()):
                self.stalls += 1
                self._lose_generator(gid, why)
        if not self.generators:  # all being replaced: the learner's wait is not theirs to time out
            self.learners[0].keep_waiting.remote()
        failures = self.last_metrics.weight_sync_failures if self.last_metrics else 0
        if set(self.generators) != members or failures > self.sync_failures:
            self.sync_failures = failures  # a group that did not form or broke: form a new one
            self._new_epoch()
        snap = ray.get(self.coordinator.snapshot.remote(self._snapshot()))
        published = JobStatus(self.cfg.job, snap, redact_url(self.redis_url), self.cfg.queue.stream,
                              self.stream.accounting(), time.time())
        cluster.write_job_status(self.cfg.job, dataclasses.asdict(published))

    def _lose_generator(self, gid: str, why: str) -> None:
        ray = self.ray
        handle = self.generators.pop(gid)
        ray.kill(handle)  # first: a half-alive generator must not finish a batch after release
        self.stall_watch.forget(gid)
        freed = ray.get(self.coordinator.release.remote(gid, self.incarnations[gid]))
        print(f"generator {gid} lost ({why}); {freed} admitted samples released", file=sys.stderr)
        budget = self.cfg.generator.max_restarts
        if self.restarts < budget:  # replaced under the same id: it goes on with its prompts
            self.restarts += 1
            delay = min(2.0 ** (self.restarts - 1), 30.0)
            self.due_restarts.append((time.monotonic() + delay, gid))
            print(f"restarting {gid} in {delay:.0f} s (restart {self.restarts} of "
                  f"generator.max_restarts={budget})", file=sys.stderr)
        else:
            print(f"not restarting {gid}: generator.max_restarts={budget} restarts spent",
                  file=sys.stderr)
            groups.release(self.groups.pop(gid))

    def _evaluations(self, version: int, last: bool) -> list[EvalResult]:
        """Held-out evaluations finished since the last step (at the last step, after that
        version's own), each logged at the version it evaluated."""
        if self.evaluator is None:
            return []
        ray = self.ray
        evals = ray.get(self.evaluator.finish.remote(version) if last else self.evaluator.take_results.remote())
        for e in evals:
            self.metrics.evaluation(e)
        return evals

    def _record(self, m: StepMetrics, step_s: float, last: bool = False) -> None:
        if "first_step" not in self.startup:
            self._mark("first_step")
            print("start-up, seconds since the command: " + ", ".join(
                f"{phase} {t:.1f}" for phase, t in self.startup.items()), flush=True)
        self.last_metrics = m
        evals = self._evaluations(m.version, last)
        self.metrics.step(StepRecord.of(m, time=time.time() - self.start_time, step_s=step_s,
                                        gen_stats=self.gen_stats.values(), generators=len(self.generators),
                                        evals=evals))
        self.step_in_flight = None

    def _snapshot(self) -> JobSnapshot:
        m = self.last_metrics
        version = m.version if m else self.start_version
        learner = LearnerStatus(step=version, policy_version=version, reward_mean=m.reward_mean if m else None,
                                of_steps=self.cfg.learner.steps, pid=self.learner_pid,
                                restarts=self.learner_restarts, hangs=self.learner_hangs)
        return JobSnapshot(job=self.cfg.job, out=str(self.out), learner=learner,
                           generators=tuple(self.gen_stats.values()), generator_restarts=self.restarts,
                           generator_stalls=self.stalls)

    # -- the end ---------------------------------------------------------------------------
    def _finish(self) -> None:
        """Stop generators and account for every trajectory; first the learner's final checkpoint
        and export, unless the loop did them (stopped, interrupted or failed before: the calls
        the loop made, if any, are waited for rather than made again)."""
        ray = self.ray
        if self.learners and not self.export:
            try:  # first: a step in flight completes with the generators still feeding it
                if self.error:  # ...unless the job failed: their data may never come
                    ray.get([l.give_up_waiting.remote() for l in self.learners], timeout=60)
                self.finishing = self.finishing or [l.finish.remote() for l in self.learners]
                self.export = ray.get(self.finishing, timeout=self.cfg.learner.step_timeout_s)[0]
            except Exception as e:  # noqa: BLE001 - a failed learner must not block the summary
                log.error("learner checkpoint failed: %s", e)
                for learner in self.learners:
                    ray.kill(learner)
        if self.export:
            print(f"policy exported to {self.export}")
        for gid, handle in {**self.generators, **{g: h for g, (h, _) in self.starting.items()}}.items():
            try:
                self.gen_stats[gid] = ray.get(handle.stop.remote(), timeout=120)
            except Exception as e:  # noqa: BLE001 - a dead generator must not block the summary
                log.warning("stopping %s: %s", gid, e)
        self.summary = JobSummary(
            accounting=self.stream.queue.accounting() if self.stream is not None else None,
            generators=tuple(self.gen_stats.values()),
            wall_s=time.time() - self.start_time,  # since the command, before Ray and Redis stop
            redis_restarts=self.stream.restarts if self.stream is not None else 0,
            generator_stalls=self.stalls, learner_restarts=self.learner_restarts,
            learner_hangs=self.learner_hangs, startup=self.startup,
            placement=self.placement_line or "manual", error=self.error)
        self._write_summary()
        if self.metrics is not None:
            self.metrics.close()
        print(self.summary.line())


class _RankDied(Exception):
    """A learner rank died or hung, in a step or in the final checkpoint (the message: why)."""


@functools.cache
def _gpu_count() -> int:
    """The GPUs torch sees here; 0 at once on a machine without a GPU driver (importing torch
    to find that out takes seconds, before anything else can start)."""
    if not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidia0", "/dev/kfd")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
