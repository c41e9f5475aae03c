"""The generator: admission -> prompts -> engine (continuous batching) -> score -> experience queue.

A plain class (the launcher makes it a Ray actor). `run()` works in two threads:

- The engine loop keeps up to max_inflight sequences in the engine. Between two engine steps
  it (1) lets a waiting weight update load, at the safe point below; (2) fills free slots: for
  each group_size free it asks the admission gate (AdmissionGate: the staleness bound, keyed by
  the launcher on this engine's policy_version) for one group and submits the next prompt;
  (3) runs one engine step and hands every group that finished to the scorer. With nothing in
  the engine and nothing admitted it waits (idle time) for the learner to advance.
  schedule=lockstep instead admits a whole batch (max_inflight sequences, one gate call) into
  an empty engine and the next batch only once its longest sequence has ended: the old
  generator, kept for comparison.
- Scorer threads, one per reward worker process (generator.reward_concurrency), score the
  finished groups while the engine goes on, each group in one thread, and make each one Group;
  a reward call past its deadline has its worker process killed (actors/reward_pool.py), so a
  hung reward holds back neither the engine nor the other groups, and leaves nothing behind.
  A group reaches the stream whole or not at all (GRPO and RLOO baselines assume all n
  samples): if any member's reward failed (raised, timed out, NaN, bad output) or the group
  fails Group.validate(), it is set aside: counted once under the first failure's reason,
  logged, and sent to the queue's dead-letter stream with its prompt and responses. The others
  go on the queue, one entry per group, as soon as scored (this blocks while the backlog is
  over its bound: backpressure), except that a group admitted with version v waits for every
  group admitted with an older version: the gate's bound assumes groups reach the learner in
  the order of their admission versions (async_rlhf/staleness.py), and with responses of
  varying length a short new group would otherwise overtake a long old one, which the learner
  then drops as too stale. Either way the gate learns how many admitted samples made it.

Weight updates (`apply_weights`, from another thread) load at the engine loop's safe point:
with weight_updates=inflight between any two steps, the sequences in flight going on with the
new weights (the engine keeps their KV cache: see actors/engines/vllm_engine.py); with
between_groups once the engine is empty, admission paused while an update waits, so one
version samples every token of a group. Each trajectory records which version sampled which
tokens (version_spans) and its policy_version is the oldest of them: the staleness the gate
bounds and the learner checks is the oldest token's, which an in-flight update only makes newer.

Prompt positions: each put records how many prompts this generator has taken. A generator that
restarts under its id continues from the last recorded position: the groups that were in its
engine when it died are skipped, never generated twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Literal

import numpy as np

from async_rlhf.config import Config
from async_rlhf.hub import context_length, resolve_model
from async_rlhf.messages import GeneratorStats
from async_rlhf.protocols import AdmissionGate, ExperienceQueue, GenerationEngine
from async_rlhf.types import Group, Prompt, Sample, Trajectory, TrajectoryError

from actors.agents import AgentEngine
from actors.dynamic_sampling import DrawBound
from actors.episodes import EpisodeEngine, episodes_of
from actors.prompts import PromptStream, make_prompt_stream
from actors.rewards import Scored, Scorer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Flight:
    """A group in the engine; its key is also its group id."""

    key: str
    prompt: Prompt
    version: int  # the weights' version when the gate admitted it
    started: float = field(default_factory=time.perf_counter)


class Generator:
    """Counters are written by one thread each (engine loop: steps, idle; the caller of
    apply_weights: updates) or under `_results` (the scorer threads: scoring and puts)."""

    def __init__(
        self,
        engine: GenerationEngine,
        prompts: PromptStream,
        scorer: Scorer,
        queue: ExperienceQueue,
        gate: AdmissionGate,
        *,
        generator_id: str = "gen-0",
        group_size: int = 4,
        max_inflight: int = 64,
        schedule: Literal["stream", "lockstep"] = "stream",
        weight_updates: Literal["inflight", "between_groups"] = "inflight",
        drop_uniform_groups: bool = False,
        max_draws_per_group: int = 4,
        poll_s: float = 0.05,
    ):
        if max_inflight < group_size:
            raise ValueError(f"max_inflight ({max_inflight}) must be >= group_size ({group_size})")
        self.engine, self.prompts, self.scorer, self.queue, self.gate = engine, prompts, scorer, queue, gate
        self.generator_id = generator_id
        self.group_size, self.max_inflight = group_size, max_inflight
        self.schedule, self.weight_updates = schedule, weight_updates
        self.drop_uniform_groups = drop_uniform_groups
        self._draws = DrawBound(max_draws_per_group, generator_id)  # scorer threads, under _results
        self.poll_s = poll_s
        # a generator that restarts (replaced, or its job resumed) continues its prompt stream
        # where the groups it put in the stream end
        self.prompt_start = queue.prompt_positions().get(generator_id, 0)
        prompts.seek(self.prompt_start)
        self._taken = self.prompt_start  # prompts taken (the loop writes it, the scorer reads it)
        self._inflight: dict[str, _Flight] = {}  # engine loop only (and apply_weights while parked)
        self._scoring: SimpleQueue[tuple[_Flight, list[Sample], float] | None] = SimpleQueue()
        self._held: list[tuple[_Flight, Group]] = []  # scored, waiting for older groups
        # the scorer threads' results: held groups, puts, set-asides and their counters
        self._results = threading.Lock()
        self._open: Counter[int] = Counter()  # admission version -> groups not yet put or set aside
        self._open_lock = threading.Lock()
        self._error: Exception | None = None  # the scorer's, raised by run()
        self._engine_lock = threading.Lock()  # a step, an abort and a weight load never overlap
        self._gate_lock = threading.Lock()  # both threads call the gate
        self._updates = threading.Condition()  # the safe-point handshake with apply_weights
        self._updates_waiting = 0
        self._parked = False  # the engine loop waits at its safe point for updates to load
        self._looping = False
        self._counts: Counter[str] = Counter()
        self._seconds: Counter[str] = Counter()
        self._set_aside: Counter[str] = Counter()
        self._last_reward = float("nan")

    # -- weights ---------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The version of the weights the engine holds."""
        return self.engine.policy_version

    def apply_weights(self, load: Callable[[], object]) -> None:
        """Run `load` (which loads new weights into the engine: received now from the learner's
        broadcast, or staged before) at the engine loop's next safe point (at once when no loop
        runs); returns when it has run."""
        start = time.perf_counter()
        with self._updates:
            self._updates_waiting += 1
            self._updates.notify_all()  # an idle loop comes to its safe point at once
            self._updates.wait_for(lambda: self._parked or not self._looping)
        try:
            with self._engine_lock:
                loaded = time.perf_counter()
                load()
                self._seconds["weight_update"] += time.perf_counter() - loaded
            self._counts["inflight_updates"] += bool(self._inflight)  # sequences went on with it
        finally:
            with self._updates:
                self._updates_waiting -= 1
                self._updates.notify_all()
        self._seconds["weight_wait"] += loaded - start  # for the safe point
        self._counts["weight_updates"] += 1

    def _safe_point(self) -> None:
        """Between two steps: park while waiting updates load (with between_groups only once
        the engine is empty; until then `_admit` admits nothing, so it empties)."""
        with self._updates:
            if not self._updates_waiting or (self.weight_updates == "between_groups" and self._inflight):
                return
            self._parked = True
            self._updates.notify_all()
            self._updates.wait_for(lambda: not self._updates_waiting)
            self._parked = False

    # -- the engine loop -------------------------------------------------------------------
    def run(self, stop: threading.Event, max_groups: int | None = None) -> GeneratorStats:
        """Generate until `stop` is set (or max_groups groups have been admitted and are done);
        returns stats(). At a stop, groups still in the engine are aborted and their
        admissions given back; those already finished are scored and put first."""
        self.scorer.pool.start()  # the rewards load before generation, not in a group's deadline
        scorers = [threading.Thread(target=self._score_loop, name=f"{self.generator_id}-score-{i}",
                                    daemon=True) for i in range(self.scorer.pool.size)]
        for thread in scorers:
            thread.start()
        with self._updates:
            self._looping = True
        admitted, start = 0, time.perf_counter()
        try:
            while not stop.is_set() and self._error is None:
                self._safe_point()
                admitted += self._admit(None if max_groups is None else max_groups - admitted)
                if self._inflight:
                    self._step()
                elif max_groups is not None and admitted >= max_groups:
                    break
                else:
                    self._idle(stop)
        finally:
            with self._updates:
                self._looping = False
                self._updates.notify_all()
            self._abort_inflight()
            for _ in scorers:
                self._scoring.put(None)
            for thread in scorers:
                thread.join()
            with self._results:
                self._guarded(self._release)  # nothing is in flight any more: the held groups all go
            self.scorer.pool.close()
            self._seconds["run"] += time.perf_counter() - start
        if self._error is not None:
            raise self._error
        return self.stats()

    def _admit(self, most: int | None) -> int:
        """Submit as many groups (at most `most`) as there are free slots and the gate admits;
        returns how many."""
        n = self.group_size
        if self._updates_waiting and self.weight_updates == "between_groups":
            return 0  # the engine empties first
        if self.schedule == "lockstep" and self._inflight:
            return 0  # the batch's longest sequence has not ended
        free = (self.max_inflight - self.engine.num_sequences) // n
        free = free if most is None else min(free, most)
        if free <= 0:
            return 0
        with self._gate_lock:
            if self.schedule == "lockstep":
                groups = free if self.gate.try_admit(free * n) else 0
            else:
                groups = 0
                while groups < free and self.gate.try_admit(n):
                    groups += 1
        version = self.engine.policy_version  # what the gate admitted them for
        with self._open_lock:
            self._open[version] += groups
        for _ in range(groups):
            prompt = next(self.prompts)
            flight = _Flight(f"{self.generator_id}/{self._taken}/{prompt.prompt_id}", prompt, version)
            self._taken += 1
            self.engine.submit(flight.key, prompt, n)
            self._inflight[flight.key] = flight
        return groups

    def _step(self) -> None:
        sequences = self.engine.num_sequences
        with self._engine_lock:
            start = time.perf_counter()
            finished = self.engine.step()
            elapsed = time.perf_counter() - start
        self._seconds["generate"] += elapsed
        self._seconds["sequences"] += sequences * elapsed  # sequence-seconds: mean in flight
        self._counts["steps"] += 1
        now = time.perf_counter()
        for key, samples in finished:
            flight = self._inflight.pop(key)
            self._scoring.put((flight, samples, now - flight.started))

    def _idle(self, stop: threading.Event) -> None:
        """Nothing in the engine, nothing admitted: wait a poll (a weight update, which is what
        a refusing gate waits for, ends the wait at once)."""
        start = time.perf_counter()
        with self._updates:
            self._updates.wait_for(lambda: self._updates_waiting or stop.is_set(), self.poll_s)
        self._seconds["idle"] += time.perf_counter() - start

    def _abort_inflight(self) -> None:
        if not self._inflight:
            return
        with self._engine_lock:
            self.engine.abort(list(self._inflight))
        with self._gate_lock:
            self.gate.finish(self.group_size * len(self._inflight), 0)
        with self._open_lock:
            self._open.subtract(f.version for f in self._inflight.values())
        self._counts["aborted"] += len(self._inflight)
        self._inflight.clear()

    # -- the scorer thread -----------------------------------------------------------------
    def _score_loop(self) -> None:
        while (item := self._scoring.get()) is not None:
            self._guarded(self._score, *item)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - run() raises it in the engine loop's thread
            self._error = self._error or e

    def _score(self, flight: _Flight, samples: list[Sample], gen_s: float) -> None:
        """Score one finished group: set it aside, or hold it for `_release`."""
        if self._error is not None:  # after a failed put the rest only give their slots back
            self._resolved(flight, 0)
            return
        start = time.perf_counter()
        scored = self.scorer.score_samples([flight.prompt] * len(samples), samples)
        with self._results:
            self._seconds["score"] += time.perf_counter() - start
            group = self._group(flight, samples, scored, gen_s)
            if isinstance(group, Group) and self._dropped(group):
                self._resolved(flight, 0)
            elif isinstance(group, Group):
                self._held.append((flight, group))
            else:
                self._set_aside_group(flight.prompt, samples, *group)
                self._resolved(flight, 0)
            self._release()  # whatever became of it, newer groups held behind it may go now

    def _release(self) -> None:
        """Put the held groups whose admission version no open group's is older than."""
        self._held.sort(key=lambda held: held[0].version)
        while self._held:
            flight, group = self._held[0]
            with self._open_lock:
                if flight.version > min(v for v, n in self._open.items() if n > 0):
                    return
            del self._held[0]
            accepted = 0
            try:
                if self._error is None:
                    self._put(group)
                    accepted = group.size
            finally:
                self._resolved(flight, accepted)

    def _resolved(self, flight: _Flight, accepted: int) -> None:
        """The group is put (`accepted` samples) or set aside (0): its gate slots are done."""
        with self._open_lock:
            self._open[flight.version] -= 1
        with self._gate_lock:
            self.gate.finish(self.group_size, accepted)

    def _put(self, group: Group) -> None:
        start = time.perf_counter()
        self.queue.put([group], prompt_position=self._taken)
        self._seconds["put"] += time.perf_counter() - start
        self._counts["produced"] += group.size
        self._counts["groups"] += 1
        self._counts["tokens"] += sum(len(t.response_ids) for t in group.members)
        self._last_reward = float(np.mean([t.reward for t in group.members]))

    def _group(
        self, flight: _Flight, samples: list[Sample], scored: list[Scored], gen_s: float
    ) -> Group | tuple[str, str]:
        """The group, or (reason, detail) to set it aside under: the first failed reward's,
        else invalid_<the group's validation reason>."""
        failure = next((r.failure for r in scored if r.failure is not None), None)
        if failure is not None:
            return failure
        group = Group(tuple(self._trajectory(flight, s, r, gen_s) for s, r in zip(samples, scored)))
        try:
            group.validate()
        except TrajectoryError as e:
            return f"invalid_{e.reason}", e.detail
        return group

    def _trajectory(self, flight: _Flight, sample: Sample, result: Scored, gen_s: float) -> Trajectory:
        return Trajectory(
            prompt_ids=np.asarray(flight.prompt.token_ids if sample.prompt_ids is None else sample.prompt_ids,
                                  dtype=np.int32),
            response_ids=sample.response_ids,
            behavior_logprobs=sample.behavior_logprobs,
            reward=result.reward,
            reward_parts=result.parts,
            policy_version=sample.policy_version,
            generator_id=self.generator_id,
            group_id=flight.key,
            finished=sample.finished,
            generation_s=gen_s,
            version_spans=sample.version_spans,
            observation_spans=sample.observation_spans,
        )

    def _dropped(self, group: Group) -> bool:
        """Dynamic sampling (DAPO): a group whose rewards are all equal has advantage 0 for
        every sample, so it is dropped, counted, and its gate slots freed for another; unless
        this generator's recent draws per group put would pass generator.max_draws_per_group
        (actors/dynamic_sampling.py): then it goes on, so steps keep the generation rate."""
        if not (self.drop_uniform_groups and self._draws.drop(_uniform(group))):
            return False
        self._counts["dropped_uniform"] += 1
        try:
            self.queue.count_dropped("uniform")
        except Exception:  # noqa: BLE001 - the count is the stream's; generation goes on
            log.exception("%s: could not count a dropped uniform group", self.generator_id)
        return True

    def _set_aside_group(self, prompt: Prompt, samples: list[Sample], reason: str, detail: str) -> None:
        self._set_aside[reason] += 1
        if self._set_aside[reason] in (1, 10, 100) or self._set_aside[reason] % 1000 == 0:
            log.warning("%s: group of %d samples set aside (%s, %d groups so far): %s", self.generator_id,
                        len(samples), reason, self._set_aside[reason], detail)
        payload = json.dumps({
            "generator_id": self.generator_id, "prompt_id": prompt.prompt_id, "prompt": prompt.text,
            "responses": [s.text for s in samples],
            "policy_version": min(s.policy_version for s in samples),
        }).encode()
        try:
            self.queue.dead_letter(reason, detail, payload)
        except Exception:  # noqa: BLE001 - losing the dead letter must not stop generation
            log.exception("%s: could not dead-letter a %s group", self.generator_id, reason)
            self._counts["dead_letter_errors"] += 1

    def stats(self) -> GeneratorStats:
        """Counters and seconds since start (see GeneratorStats for what each counts)."""
        gen_s = self._seconds["generate"]
        drawn, dropped, admitted = self._draws.counts
        return GeneratorStats(
            generator_id=self.generator_id,
            policy_version=self.engine.policy_version,
            schedule=self.schedule,
            update_mode=self.weight_updates,
            prompt_start=self.prompt_start,
            prompt_position=self._taken,
            produced=self._counts["produced"],
            groups=self._counts["groups"],
            tokens=self._counts["tokens"],
            steps=self._counts["steps"],
            aborted=self._counts["aborted"],
            set_aside=dict(self._set_aside),
            set_aside_total=sum(self._set_aside.values()),
            dropped_uniform=self._counts["dropped_uniform"],
            recent_drawn=drawn,
            recent_dropped=dropped,
            admitted_uniform=admitted,
            dead_letter_errors=self._counts["dead_letter_errors"],
            weight_updates=self._counts["weight_updates"],
            inflight_updates=self._counts["inflight_updates"],
            run_s=self._seconds["run"],
            generate_s=gen_s,
            score_s=self._seconds["score"],
            put_s=self._seconds["put"],
            idle_s=self._seconds["idle"],
            weight_update_s=self._seconds["weight_update"],
            weight_wait_s=self._seconds["weight_wait"],
            mean_inflight=self._seconds["sequences"] / gen_s if gen_s else 0.0,
            sequences=len(self._inflight) * self.group_size,  # len(): safe from another thread
            updates_waiting=self._updates_waiting,
            tokens_per_s=self._counts["tokens"] / gen_s if gen_s else 0.0,
            last_mean_reward=self._last_reward,
            **({"episodes": self.engine.episodes, "turns": self.engine.turns, "env_s": self.engine.env_s}
               if isinstance(self.engine, (EpisodeEngine, AgentEngine)) else {}),
            **({"rewrites": self.engine.rewrites} if isinstance(self.engine, AgentEngine) else {}),
        )


def make_generator(
    cfg: Config,
    queue: ExperienceQueue,
    gate: AdmissionGate,
    *,
    index: int = 0,
    engine: GenerationEngine | None = None,
    device: str | None = None,
) -> Generator:
    """Generator number `index` of a job: its engine, prompt stream and scorer from `cfg`, its
    reward workers started: a reward that cannot load fails here, at the generator's start (the
    job ends with the cause), not in its engine loop after it was ready (where each restart
    failed again, for minutes).

    The model directory must exist (the launcher calls actors.model_init.ensure_model once); a Hub
    id is resolved through this node's Hugging Face cache."""
    from transformers import AutoConfig, AutoTokenizer

    from actors.engines import make_engine

    g = cfg.generator
    path = resolve_model(cfg.model.path)
    context = context_length(AutoConfig.from_pretrained(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_prompt_stream(cfg.data, tokenizer, seed=cfg.seed, stream=index,
                                 max_tokens=context and context - cfg.response_limit,
                                 max_prompt_tokens=g.max_prompt_tokens)
    scorer = Scorer.from_specs(cfg.rewards, g.reward_concurrency)
    scorer.pool.spawn()  # the rewards load while the engine starts
    try:
        engine = episodes_of(cfg, engine or make_engine(g, path, seed=cfg.seed + index, device=device,
                                                        model_dtype=cfg.model.dtype), tokenizer)
    except BaseException:
        scorer.pool.close()
        raise
    scorer.pool.start()
    return Generator(
        engine,
        prompts,
        scorer,
        queue,
        gate,
        generator_id=f"gen-{index}",
        group_size=g.group_size,
        max_inflight=g.max_inflight,
        schedule=g.schedule,
        weight_updates=g.weight_updates,
        drop_uniform_groups=g.drop_uniform_groups,
        max_draws_per_group=g.max_draws_per_group,
    )


def _uniform(group: Group) -> bool:
    """All of the group's rewards are equal (a group of one never is: RLOO-style baselines
    aside, nothing is learnt from it either way, and dropping every group would starve the job)."""
    return group.size > 1 and len({t.reward for t in group.members}) == 1
