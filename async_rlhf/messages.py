"""What the parts report, one frozen dataclass per message: a learner step's metrics, a held-out
evaluation, a generator's stats, the running job's snapshot (`async-rlhf status`) and the job's
summary with the accounting of every group; also where a weight-sync epoch meets. They cross Ray
as they are (pickled), and none of them imports torch (the launcher unpickles them). On disk the
reports are flat JSON (`to_json` / `from_json`): OUT/metrics.jsonl rows, OUT/summary.json,
`status --json`, whose keys (and TensorBoard's tags) stay what users' dashboards read. Readers use
the fields, so a renamed one fails where it is read, in the fast tests (tests/test_messages.py),
not at the end of a long run. An `extra` or counter mapping holds what is open-ended (stats that
only some configs have, counts by reason)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


def _field_sums(cls, items: Iterable[Any]):
    """A `cls` whose every field is the sum of that attribute over `items`."""
    items = list(items)
    return cls(**{f.name: sum(getattr(i, f.name) for i in items) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class SyncAddress:
    """Where the members of one weight-sync epoch meet (async_rlhf/weight_sync.py); the launcher
    receives it from the learner and passes it on to the generators."""

    host: str
    port: int
    epoch: int
    world_size: int  # the learner + every receiving rank
    backend: str  # "gloo" or "nccl"
    key: str  # the epoch's secret: the group's store prefix, which only its members know
    timeout_s: float = 60.0  # formation and each collective


@dataclass(frozen=True)
class StepTimes:
    """Seconds one learner step spent in each phase (time_<phase> in metrics.jsonl)."""

    wait: float  # for a batch from the stream (rank 0), then its broadcast to the ranks
    recompute: float  # pi_prox, reference log-probs, critic values
    forward: float
    backward: float
    step: float  # optimizer steps
    weight_gather: float
    publish: float
    checkpoint: float = 0.0  # 0 on steps without a checkpoint

    @classmethod
    def total(cls, times: Iterable[StepTimes]) -> StepTimes:
        """Each phase's seconds summed over steps."""
        return _field_sums(cls, times)


@dataclass(frozen=True)
class Completion:
    """One trained response as people read it (OUT/completions.jsonl): its text, reward as
    scored and its parts by reward name, its advantage (None for token-level estimators), the
    oldest version that sampled it and its staleness when trained, and whether it ended by
    itself (False: cut at the response limit)."""

    response: str
    reward: float
    reward_parts: Mapping[str, float]
    advantage: float | None
    policy_version: int
    staleness: int
    tokens: int
    finished: bool


@dataclass(frozen=True)
class CompletionGroup:
    """The responses of one prompt that learner step `step` trained on."""

    step: int
    prompt: str
    generator_id: str
    responses: tuple[Completion, ...]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class StepMetrics:
    """One learner step (one policy version), as Learner.step returns it; loss stats are
    averaged over the step's optimizer steps, samples and tokens are the batch's. `extra`: loss
    stats only some configs have (kl with a reference model; value_loss and value_clip_frac
    with a critic). `counts`: the learner's counters since it started (count_<name>: samples,
    tokens, groups, dropped_stale, rejected_<reason>, ...). weight_sync_*: rank 0's publish of
    the step's weights (0 without a broadcaster): seconds the learner spent on it (packing; the
    transfer runs beside the next step), the bytes of the newest update its members have taken,
    and the failed sends so far."""

    version: int
    loss: float
    loss_policy: float
    entropy: float
    clip_frac: float
    ratio_mean: float
    bw_mean: float  # behaviour correction weight pi_prox / pi_behaviour
    bw_capped_frac: float
    bw_max: float
    grad_norm: float  # NaN when every optimizer step was skipped
    lr: float  # the policy's learning rate in this step's optimizer steps (learner.lr_schedule)
    skipped_nonfinite: int  # optimizer steps skipped for a non-finite loss or gradient
    samples: int
    samples_fresh: int  # first use; the rest were re-used from the replay buffer
    tokens: int
    reward_mean: float
    groups: int
    group_size_min: int
    groups_singleton: int  # zero advantage under grpo/rloo
    staleness_max: int
    staleness_mean: float
    staleness_hist: Mapping[int, int]  # versions old -> samples
    staleness_token_mean: float  # per response token, by the weights that sampled it
    reward_by_version: Mapping[int, tuple[int, float]]  # generating version -> (samples, mean reward)
    trained_by_generator: Mapping[str, int]  # generator id -> samples
    times: StepTimes
    counts: Mapping[str, int]
    weight_sync_s: float = 0.0
    weight_sync_bytes: int = 0
    weight_sync_failures: int = 0
    extra: Mapping[str, float] = field(default_factory=dict)
    # What the batch's responses look like (learners/samples.py; 0 in rows written before they
    # existed): model-sampled tokens per response, the share cut at the response limit, the mean
    # within-group std of the rewards, the share of groups whose rewards are all equal (zero
    # GRPO/RLOO advantage), each reward's mean by name (reward/<name> in the row)
    response_len_mean: float = 0.0
    response_len_max: int = 0
    response_truncated_frac: float = 0.0
    reward_group_std: float = 0.0
    groups_zero_adv_frac: float = 0.0
    reward_parts: Mapping[str, float] = field(default_factory=dict)
    # every log.completions_every steps, the first log.completions_groups groups trained (not in the row)
    completions: tuple[CompletionGroup, ...] = ()

    _NESTED = ("times", "counts", "extra", "reward_parts", "completions")

    def to_json(self) -> dict[str, Any]:
        """The flat row: fields, then extra, time_<phase> and count_<name>."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self._NESTED}
        out["staleness_hist"] = dict(self.staleness_hist)
        out["reward_by_version"] = {v: list(nr) for v, nr in self.reward_by_version.items()}
        out["trained_by_generator"] = dict(self.trained_by_generator)
        return {**out, **self.extra, **{f"time_{k}": v for k, v in dataclasses.asdict(self.times).items()},
                **{f"count_{k}": v for k, v in self.counts.items()},
                **{f"reward/{k}": v for k, v in self.reward_parts.items()}}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> StepMetrics:
        """A row of to_json (JSON's string keys back to versions); keys that are no field go to
        extra, and a missing field raises TypeError."""
        names = {f.name for f in dataclasses.fields(cls)} - set(cls._NESTED)
        times = {k[5:]: v for k, v in row.items() if k.startswith("time_")}
        counts = {k[6:]: v for k, v in row.items() if k.startswith("count_")}
        parts = {k[7:]: v for k, v in row.items() if k.startswith("reward/")}
        extra = {k: v for k, v in row.items()
                 if k not in names and not k.startswith(("time_", "count_", "reward/"))}
        own = {k: v for k, v in row.items() if k in names}
        own["staleness_hist"] = {int(k): v for k, v in row["staleness_hist"].items()}
        own["reward_by_version"] = {int(k): (int(n), float(m)) for k, (n, m) in row["reward_by_version"].items()}
        return cls(**own, times=StepTimes(**times), counts=counts, extra=extra, reward_parts=parts)


@dataclass(frozen=True)
class EvalResult:
    """One held-out evaluation of one policy version (actors.evaluate.Evaluator): the mean
    greedy reward over `prompts` held-out prompts; with eval.samples = k > 0 (`samples`), also
    the mean reward of k samples per prompt at the training temperature and pass@k (None without
    samples). `failed`: samples whose reward failed, left out of the means. In metrics.jsonl and
    TensorBoard as eval_reward, eval_prompts, eval_failed, eval_s, eval_reward_sampled and
    eval_pass@<k>."""

    policy_version: int
    reward: float
    prompts: int
    failed: int
    seconds: float
    samples: int = 0
    reward_sampled: float | None = None
    pass_at_k: float | None = None

    def scalars(self) -> dict[str, float]:
        """The eval_* numbers, keyed as in metrics.jsonl and TensorBoard."""
        out = {"eval_reward": self.reward, "eval_prompts": self.prompts, "eval_failed": self.failed,
               "eval_s": self.seconds}
        if self.samples:
            out |= {"eval_reward_sampled": self.reward_sampled, f"eval_pass@{self.samples}": self.pass_at_k}
        return out

    def to_json(self) -> dict[str, Any]:
        return {"policy_version": self.policy_version, **self.scalars()}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> EvalResult:
        passes = [k for k in row if k.startswith("eval_pass@")]
        return cls(row["policy_version"], row["eval_reward"], row["eval_prompts"], row["eval_failed"],
                   row["eval_s"], samples=int(passes[0][len("eval_pass@"):]) if passes else 0,
                   reward_sampled=row.get("eval_reward_sampled"),
                   pass_at_k=row[passes[0]] if passes else None)


@dataclass(frozen=True)
class GeneratorStats:
    """A generator's counters and seconds since it started (actors.generator.Generator.stats).
    `produced` and `tokens` count samples put on the queue, `groups` the groups they came in
    (one stream entry each); `set_aside` counts groups set aside, by reason. Engine loop time is
    generate_s (steps) + idle_s (nothing to run) + weight_update_s; score_s and put_s overlap it
    (score_s sums the scorer threads'). mean_inflight: sequences in the engine, averaged over
    the steps' time (`sequences`: now); inflight_updates: weight updates that sequences in flight went on with.
    node, pid, node_id, weight_receive_s and error are the Ray actor's (empty outside one)."""

    generator_id: str
    policy_version: int
    schedule: str
    update_mode: str
    prompt_start: int
    prompt_position: int
    produced: int
    groups: int
    tokens: int
    steps: int
    aborted: int
    set_aside: Mapping[str, int]
    set_aside_total: int
    dropped_uniform: int  # groups whose rewards were all equal, dropped (generator.drop_uniform_groups)
    dead_letter_errors: int
    weight_updates: int
    inflight_updates: int
    run_s: float
    generate_s: float
    score_s: float
    put_s: float
    idle_s: float
    weight_update_s: float  # at the safe point: loading (receiving too, for an update taken straight in)
    weight_wait_s: float  # waiting for the safe point
    mean_inflight: float
    sequences: int  # in the engine now
    updates_waiting: int  # weight updates waiting for the engine loop's safe point, or loading, now
    tokens_per_s: float
    last_mean_reward: float
    node: str = ""
    pid: int = 0
    node_id: str = ""
    weight_receive_s: float = 0.0
    error: str = ""  # the traceback that ended its loop, if one did
    episodes: int = 0  # with env.target: episodes ended, their model turns, seconds in environment calls
    turns: int = 0
    env_s: float = 0.0
    # with env.agent: calls left out of their episode's trajectory, a later call having
    # rewritten the history they were part of (actors/agents.py)
    rewrites: int = 0
    # with generator.drop_uniform_groups: its recent groups drawn (the window of
    # generator.max_draws_per_group's bound, actors/dynamic_sampling.py) and, of them, dropped;
    # uniform groups put since the start because dropping them would have passed that bound
    recent_drawn: int = 0
    recent_dropped: int = 0
    admitted_uniform: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GeneratorStats:
        return cls(**d)


@dataclass(frozen=True)
class GeneratorTotals:
    """Generator counters summed over generators (metrics.jsonl's gen_totals): `bench` takes
    differences over its timed window for idle fractions and generated tokens/s."""

    tokens: float = 0.0
    produced: float = 0.0
    generate_s: float = 0.0
    score_s: float = 0.0
    put_s: float = 0.0
    idle_s: float = 0.0
    weight_update_s: float = 0.0
    dropped_uniform: float = 0.0
    admitted_uniform: float = 0.0
    episodes: float = 0.0
    turns: float = 0.0
    env_s: float = 0.0
    rewrites: float = 0.0

    @classmethod
    def of(cls, stats: Iterable[GeneratorStats]) -> GeneratorTotals:
        return _field_sums(cls, stats)

    def minus(self, earlier: GeneratorTotals) -> GeneratorTotals:
        return GeneratorTotals(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                                  for f in dataclasses.fields(self)})

    @property
    def engine_loop_s(self) -> float:
        """The generators' engine loop time: steps, idle and weight loads."""
        return self.generate_s + self.idle_s + self.weight_update_s


# -- the experience stream's accounting -------------------------------------------------------
# counters that record events rather than where an entry went
_EVENTS = ("produced", "foreign", "reclaimed", "ack_lost", "set_aside", "dropped_uniform")


def not_trained(counters: Mapping[str, int]) -> int:
    """Our producers' entries gone without training (stale, malformed, dead-lettered...), from
    the stream's shared counters (buffer.redis_stream): each held slots of the staleness gate.
    Another client's entries that did not decode (dead_lettered_foreign) never did."""
    return sum(v for k, v in counters.items()
               if not k.startswith(_EVENTS) and k not in ("trained", "dead_lettered_foreign"))


@dataclass(frozen=True)
class Accounting:
    """Where every stream entry (group, of generator.group_size samples) went: produced (by
    our producers) plus foreign (written by anyone else, counted at first delivery, and those
    still undelivered) = trained + dropped_stale + dead_lettered + acked_other (other ack
    reasons) + awaiting_checkpoint + left_in_queue; `lost` is what that leaves over, 0 unless
    something is wrong. awaiting_checkpoint: groups the learner has trained whose update no
    checkpoint holds yet (pending in the stream; acked as trained at the next checkpoint, or
    trained again after a learner restart); left_in_queue: the other groups still in the stream.
    `set_aside` (set_aside:<reason>) counts groups the generators set aside before producing
    them, `dropped_uniform` those they dropped because all their rewards were equal
    (generator.drop_uniform_groups). `counters`: the stream's shared counters as they are."""

    produced: int
    foreign: int
    trained: int
    dropped_stale: int
    dead_lettered: int
    acked_other: Mapping[str, int]
    left_in_queue: int
    set_aside: Mapping[str, int]
    counters: Mapping[str, int]
    dropped_uniform: int = 0
    awaiting_checkpoint: int = 0

    LINE = ("produced", "foreign", "trained", "dropped_stale", "dead_lettered", "left_in_queue", "lost")

    @classmethod
    def from_counters(cls, counters: Mapping[str, int], left_in_queue: int, foreign_backlog: int,
                      awaiting_checkpoint: int = 0) -> Accounting:
        outcomes = {k: v for k, v in counters.items() if not k.startswith(_EVENTS)}
        return cls(
            produced=counters.get("produced", 0),
            foreign=counters.get("foreign", 0) + foreign_backlog,
            trained=outcomes.pop("trained", 0),
            dropped_stale=outcomes.pop("dropped_stale", 0),
            dead_lettered=outcomes.pop("dead_lettered", 0) + outcomes.pop("dead_lettered_foreign", 0),
            acked_other=outcomes,
            left_in_queue=left_in_queue,
            set_aside={k: v for k, v in counters.items() if k.startswith("set_aside:")},
            counters=dict(counters),
            dropped_uniform=counters.get("dropped_uniform", 0),
            awaiting_checkpoint=awaiting_checkpoint,
        )

    @property
    def lost(self) -> int:
        return (self.produced + self.foreign - self.trained - self.dropped_stale - self.dead_lettered
                - sum(self.acked_other.values()) - self.awaiting_checkpoint - self.left_in_queue)

    def to_json(self) -> dict[str, Any]:
        return {"unit": "groups", **dataclasses.asdict(self), "lost": self.lost}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Accounting:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True)
class JobSummary:
    """OUT/summary.json: the accounting (None when the job ended before its stream existed),
    each generator's final stats, seconds from the command to the end (wall_s, before Ray and
    Redis stop) and of its start-up phases, what placement: auto chose ("manual" otherwise), the
    error that ended the job (if one did), and the shutdown's seconds once it is done."""

    accounting: Accounting | None
    generators: tuple[GeneratorStats, ...]
    wall_s: float
    redis_restarts: int
    generator_stalls: int  # generators killed for making no progress (generator.stall_s)
    learner_restarts: int  # the learner ranks restarted together (learner.max_restarts)
    learner_hangs: int  # of them, hung: a step or the final checkpoint past its timeout
    startup: Mapping[str, float]  # phase -> seconds since the command started
    placement: str
    error: str = ""
    shutdown_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {**(self.accounting.to_json() if self.accounting else {}),
               "generators": [g.to_json() for g in self.generators], "wall_s": self.wall_s,
               "redis_restarts": self.redis_restarts, "generator_stalls": self.generator_stalls,
               "learner_restarts": self.learner_restarts, "learner_hangs": self.learner_hangs,
               "startup": dict(self.startup), "placement": self.placement}
        if self.error:
            out["error"] = self.error
        if self.shutdown_s is not None:
            out["shutdown_s"] = self.shutdown_s
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobSummary:
        return cls(accounting=Accounting.from_json(d) if "produced" in d else None,
                   generators=tuple(GeneratorStats.from_json(g) for g in d["generators"]),
                   wall_s=d["wall_s"], redis_restarts=d["redis_restarts"],
                   generator_stalls=d.get("generator_stalls", 0),
                   learner_restarts=d.get("learner_restarts", 0), learner_hangs=d.get("learner_hangs", 0),
                   startup=d["startup"],
                   placement=d["placement"], error=d.get("error", ""), shutdown_s=d.get("shutdown_s"))

    def line(self) -> str:
        """The console's last word: summary: produced=..., ..., lost=... (; error: ...); other ack
        reasons (duplicate=...) where there are any, before left_in_queue."""
        acc = self.accounting
        counts = [f"{k}={getattr(acc, k)}" for k in Accounting.LINE] if acc else []
        if acc:
            at = Accounting.LINE.index("left_in_queue")
            counts[at:at] = [f"{k}={v}" for k, v in sorted(acc.acked_other.items()) if v] + (
                [f"awaiting_checkpoint={acc.awaiting_checkpoint}"] if acc.awaiting_checkpoint else [])
            counts += [f"dropped_uniform={acc.dropped_uniform}"] if acc.dropped_uniform else []
        return f"summary: {', '.join(counts)}" + (f"; error: {self.error.splitlines()[0]}" if self.error else "")


# -- the running job, for `async-rlhf status` --------------------------------------------------
@dataclass(frozen=True)
class LearnerStatus:
    step: int
    policy_version: int
    reward_mean: float | None  # None before the first step
    of_steps: int  # learner.steps
    pid: int
    restarts: int
    hangs: int = 0  # of the restarts, steps past learner.step_timeout_s


@dataclass(frozen=True)
class JobSnapshot:
    """What the launcher publishes each second (see CoordinatorSnapshot)."""

    job: str
    out: str
    learner: LearnerStatus
    generators: tuple[GeneratorStats, ...]
    generator_restarts: int
    generator_stalls: int  # generators lost for making no progress (generator.stall_s)


@dataclass(frozen=True)
class CoordinatorSnapshot:
    """The launcher's JobSnapshot with the staleness gate's counts (samples) and the
    add-generators requests not yet settled (request id -> state), from the coordinator."""

    job: JobSnapshot
    gate_accepted: int
    gate_running: int
    requests: Mapping[int, str]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CoordinatorSnapshot:
        job = d["job"]
        job = JobSnapshot(**{**job, "learner": LearnerStatus(**job["learner"]),
                             "generators": tuple(GeneratorStats.from_json(g) for g in job["generators"])})
        return cls(job, d["gate_accepted"], d["gate_running"],
                   {int(i): state for i, state in d["requests"].items()})


@dataclass(frozen=True)
class JobStatus:
    """What the launcher publishes each second (the job registry's <job>.status.json) and
    `async-rlhf status` prints: its snapshot, the stream's accounting as it read it then, and
    when (`at`, seconds since the epoch)."""

    job: str
    coordinator: CoordinatorSnapshot
    redis_url: str  # password redacted
    stream: str
    queue: Accounting
    at: float

    STALE_S = 10.0  # the launcher publishes each second, between and during learner steps

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobStatus:
        return cls(d["job"], CoordinatorSnapshot.from_json(d["coordinator"]), d["redis_url"], d["stream"],
                   Accounting.from_json(d["queue"]), d["at"])

    def to_json(self) -> dict[str, Any]:
        """`status --json`: flat, for scripts."""
        c, snap = self.coordinator, self.coordinator.job
        return {"job": self.job, "at": self.at, "learner": dataclasses.asdict(snap.learner),
                "generators": [g.to_json() for g in snap.generators],
                "generator_restarts": snap.generator_restarts, "generator_stalls": snap.generator_stalls,
                "requests": dict(c.requests),
                "gate": {"accepted": c.gate_accepted, "running": c.gate_running},
                "queue": {"redis_url": self.redis_url, "stream": self.stream, **self.queue.to_json()}}

    def lines(self, now: float) -> list[str]:
        snap, q = self.coordinator.job, self.queue
        learner = snap.learner
        out = [f"job {self.job}: learner step {learner.step} policy_version {learner.policy_version}  "
               f"restarts: learner {learner.restarts} ({learner.hangs} hung), generators "
               f"{snap.generator_restarts}; "
               f"stalled generators {snap.generator_stalls}"]
        out += [f"  {g.generator_id:>8}  node {g.node}  pid {g.pid}  policy_version {g.policy_version}  "
                f"produced {g.produced}{'  ERROR' if g.error else ''}" for g in snap.generators]
        out += [f"  generator request {i}: {state}" for i, state in self.coordinator.requests.items()]
        out.append(f"queue {self.redis_url} stream {self.stream}: backlog+pending {q.left_in_queue}, "
                   f"produced {q.produced}, trained {q.trained} (+{q.awaiting_checkpoint} awaiting a "
                   f"checkpoint), dead letters {q.dead_lettered}")
        if (age := now - self.at) > self.STALE_S:
            out.append(f"(as of {age:.0f} s ago: the launcher has published nothing since; see its log)")
        return out
