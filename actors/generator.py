"""The generator loop: admission -> prompts -> generate -> score -> experience queue.

A plain class (the launcher makes it a Ray actor). One batch, `step()`:

  1. ask the admission gate (AdmissionGate: the staleness bound, keyed by the launcher on this
     engine's policy_version) for prompts_per_batch x group_size samples; while it refuses, poll
     (new weights have to arrive first) and count the wait as idle time;
  2. take the next prompts and generate group_size samples each, recording the policy version the
     engine generates with;
  3. score every response and make each prompt's samples one Group. A group reaches the
     stream whole or not at all (GRPO and RLOO baselines assume all n samples): if any member's
     reward failed (raised, timed out, NaN, bad output) or the group fails Group.validate(), the
     whole group is set aside: counted once under the first failure's reason, logged, and sent
     to the queue's dead-letter stream with its prompt and responses, and the loop goes on;
  4. put the rest on the queue, one entry per group (this blocks while the backlog is over its
     bound: backpressure), then tell the gate how many of the admitted samples were accepted.

`apply_weights` is the weight-sync hook: it waits for the batch in flight to end (the safe point)
and loads the new weights before the next batch starts, so every trajectory's policy_version is
the version of the weights that sampled all of its tokens.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from async_rlhf.config import Config
from async_rlhf.protocols import AdmissionGate, ExperienceQueue, GenerationEngine
from async_rlhf.types import Group, Prompt, Sample, Trajectory, TrajectoryError

from actors.prompts import PromptStream, make_prompt_stream
from actors.rewards import Scored, Scorer

log = logging.getLogger(__name__)


class Generator:
    def __init__(
        self,
        engine: GenerationEngine,
        prompts: PromptStream,
        scorer: Scorer,
        queue: ExperienceQueue,
        gate: AdmissionGate,
        *,
        generator_id: str = "gen-0",
        prompts_per_batch: int = 8,
        group_size: int = 4,
        poll_s: float = 0.05,
    ):
        self.engine = engine
        self.prompts = prompts
        self.scorer = scorer
        self.queue = queue
        self.gate = gate
        self.generator_id = generator_id
        self.prompts_per_batch = prompts_per_batch
        self.group_size = group_size
        self.poll_s = poll_s
        # a generator that restarts (replaced, or its job resumed) continues its prompt stream
        # where the groups it put in the stream end
        self.prompt_start = queue.prompt_positions().get(generator_id, 0)
        prompts.seek(self.prompt_start)
        self._engine_lock = threading.Lock()  # held while generating: weights change only between batches
        self._counts: Counter[str] = Counter()
        self._seconds: Counter[str] = Counter()
        self._set_aside: Counter[str] = Counter()
        self._last_reward = float("nan")

    @property
    def batch_samples(self) -> int:
        return self.prompts_per_batch * self.group_size

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights at the next safe point (blocks while a batch is being generated)."""
        start = time.perf_counter()
        with self._engine_lock:
            loaded = time.perf_counter()
            self.engine.update_weights(named_tensors, version)
            self._seconds["weight_update"] += time.perf_counter() - loaded
        self._seconds["weight_wait"] += loaded - start  # for the batch in flight to end
        self._counts["weight_updates"] += 1

    def run(self, stop: threading.Event, max_batches: int | None = None) -> dict[str, Any]:
        """Generate batches until `stop` is set or max_batches are done; returns stats()."""
        done = 0
        while not stop.is_set() and (max_batches is None or done < max_batches):
            if self.step(stop) is not None:
                done += 1
        return self.stats()

    def step(self, stop: threading.Event | None = None) -> int | None:
        """One batch; returns the number of samples put on the queue, all in whole groups
        (None: stopped while waiting for admission)."""
        if not self._admit(stop):
            return None
        n = self.batch_samples
        accepted = 0
        try:
            prompts = [next(self.prompts) for _ in range(self.prompts_per_batch)]
            with self._engine_lock:
                version = self.engine.policy_version
                start = time.perf_counter()
                samples = self.engine.generate(prompts, self.group_size)
                gen_s = time.perf_counter() - start
            groups = self._score(prompts, samples, version, gen_s)
            start = time.perf_counter()
            self.queue.put(groups, prompt_position=self.prompts.position)
            self._seconds["put"] += time.perf_counter() - start
            accepted = sum(g.size for g in groups)
        finally:
            self.gate.finish(n, accepted)  # also when something raised: free the admitted slots
        self._seconds["generate"] += gen_s
        self._counts["batches"] += 1
        self._counts["produced"] += accepted
        self._counts["groups"] += len(groups)
        self._counts["tokens"] += sum(len(t.response_ids) for g in groups for t in g.members)
        return accepted

    def _admit(self, stop: threading.Event | None) -> bool:
        """Wait until the gate admits a batch (counted as idle time as it passes); False: stopped."""
        while not self.gate.try_admit(self.batch_samples):
            start = time.perf_counter()
            stopped = stop.wait(self.poll_s) if stop is not None else time.sleep(self.poll_s)
            self._seconds["idle"] += time.perf_counter() - start
            if stopped:
                return False
        return True

    def _score(
        self, prompts: list[Prompt], samples: list[list[Sample]], version: int, gen_s: float
    ) -> list[Group]:
        """One Group per prompt whose samples all scored and validate; every other prompt's
        samples are set aside together, under the first failed reward's reason, else under
        invalid_<the group's validation reason>."""
        flat = [(p, s) for p, group in zip(prompts, samples) for s in group]
        start = time.perf_counter()
        scored = self.scorer.score([p for p, _ in flat], [s.text for _, s in flat])
        self._seconds["score"] += time.perf_counter() - start
        batch = self._counts["batches"]
        kept: list[Group] = []
        hi = 0
        for gi, (prompt, group_samples) in enumerate(zip(prompts, samples)):
            lo, hi = hi, hi + len(group_samples)
            results = scored[lo:hi]
            failure = next((r.failure for r in results if r.failure is not None), None)
            if failure is None:
                group_id = f"{self.generator_id}/{batch}/{gi}/{prompt.prompt_id}"
                group = Group(tuple(self._trajectory(prompt, s, r, version, group_id, gen_s)
                                    for s, r in zip(group_samples, results)))
                try:
                    group.validate()
                    kept.append(group)
                    continue
                except TrajectoryError as e:
                    failure = (f"invalid_{e.reason}", e.detail)
            self._set_aside_group(prompt, group_samples, version, *failure)
        if kept:
            self._last_reward = float(np.mean([t.reward for g in kept for t in g.members]))
        return kept

    def _trajectory(
        self, prompt: Prompt, sample: Sample, result: Scored, version: int, group_id: str, gen_s: float
    ) -> Trajectory:
        return Trajectory(
            prompt_ids=np.asarray(prompt.token_ids, dtype=np.int32),
            response_ids=sample.response_ids,
            behavior_logprobs=sample.behavior_logprobs,
            reward=result.reward,
            reward_parts=result.parts,
            policy_version=version,
            generator_id=self.generator_id,
            group_id=group_id,
            finished=sample.finished,
            generation_s=gen_s,
        )

    def _set_aside_group(
        self, prompt: Prompt, samples: list[Sample], version: int, reason: str, detail: str
    ) -> None:
        self._set_aside[reason] += 1
        if self._set_aside[reason] in (1, 10, 100) or self._set_aside[reason] % 1000 == 0:
            log.warning("%s: group of %d samples set aside (%s, %d groups so far): %s", self.generator_id,
                        len(samples), reason, self._set_aside[reason], detail)
        payload = json.dumps({
            "generator_id": self.generator_id, "prompt_id": prompt.prompt_id, "prompt": prompt.text,
            "responses": [s.text for s in samples], "policy_version": version,
        }).encode()
        try:
            self.queue.dead_letter(reason, detail, payload)
        except Exception:  # noqa: BLE001 - losing the dead letter must not stop generation
            log.exception("%s: could not dead-letter a %s group", self.generator_id, reason)
            self._counts["dead_letter_errors"] += 1

    def stats(self) -> dict[str, Any]:
        """Counters and seconds since start (plain types, for logs and Ray). `produced` and
        `tokens` count samples put on the queue, `groups` the groups they came in (one stream
        entry each); `set_aside` counts groups set aside, by reason."""
        gen_s = self._seconds["generate"]
        return {
            "generator_id": self.generator_id,
            "policy_version": self.engine.policy_version,
            "batches": self._counts["batches"],
            "prompt_start": self.prompt_start,
            "prompt_position": self.prompts.position,
            "produced": self._counts["produced"],
            "groups": self._counts["groups"],
            "tokens": self._counts["tokens"],
            "set_aside": dict(self._set_aside),
            "set_aside_total": sum(self._set_aside.values()),
            "dead_letter_errors": self._counts["dead_letter_errors"],
            "weight_updates": self._counts["weight_updates"],
            "generate_s": gen_s,
            "score_s": self._seconds["score"],
            "put_s": self._seconds["put"],
            "idle_s": self._seconds["idle"],
            "weight_update_s": self._seconds["weight_update"],  # loading only
            "weight_wait_s": self._seconds["weight_wait"],  # waiting for the safe point
            "tokens_per_s": self._counts["tokens"] / gen_s if gen_s else 0.0,
            "last_mean_reward": self._last_reward,
        }


def make_generator(
    cfg: Config,
    queue: ExperienceQueue,
    gate: AdmissionGate,
    *,
    index: int = 0,
    engine: GenerationEngine | None = None,
    device: str | None = None,
) -> Generator:
    """Generator number `index` of a job: its engine, prompt stream and scorer from `cfg`.

    The model directory must exist (the launcher calls actors.model_init.ensure_model once)."""
    from transformers import AutoConfig, AutoTokenizer

    from actors.engines import make_engine

    g = cfg.generator
    model_cfg = AutoConfig.from_pretrained(cfg.model.path)
    context = getattr(model_cfg, "max_position_embeddings", None) or getattr(model_cfg, "n_positions", None)
    prompts = make_prompt_stream(cfg.data, AutoTokenizer.from_pretrained(cfg.model.path), seed=cfg.seed,
                                 stream=index, max_tokens=context and context - g.max_new_tokens)
    return Generator(
        engine or make_engine(g, cfg.model.path, seed=cfg.seed + index, device=device),
        prompts,
        Scorer.from_specs(cfg.rewards),
        queue,
        gate,
        generator_id=f"gen-{index}",
        prompts_per_batch=g.prompts_per_batch,
        group_size=g.group_size,
    )
