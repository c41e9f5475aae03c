"""What a job measured, written where users read it: a row per learner step to OUT/metrics.jsonl,
its numbers to TensorBoard (and W&B, with log.wandb.project) at the step's version, and a console
line; held-out evaluations to TensorBoard at the version they evaluated, and a console line each;
the completions a step shows (log.completions_every) to OUT/completions.jsonl, TensorBoard text
and W&B's table. docs/metrics.md explains every name."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_rlhf.launch.progress import Progress
from async_rlhf.messages import CompletionGroup, EvalResult, GeneratorStats, GeneratorTotals, StepMetrics

if TYPE_CHECKING:
    from async_rlhf.launch.trackers import WandbRun


@dataclass(frozen=True)
class StepRecord:
    """A row of OUT/metrics.jsonl: the learner's step metrics and the job's view of that step.
    `time`: seconds from the command's start to the step's end; `step_s`: the step's seconds as
    the launcher saw them; gen_*: the generators' stats as of the last tick (gen_totals since
    they started, summed over generators); `generators`: how many are alive; `evals`: held-out
    evaluations finished since the last step; `uniform_drop_rate`: with dynamic sampling, the
    share of the generators' recent groups drawn that were dropped as uniform (None without)."""

    metrics: StepMetrics
    time: float
    step_s: float
    gen_tokens_per_s: float
    gen_totals: GeneratorTotals
    generators: int
    evals: tuple[EvalResult, ...] = ()
    uniform_drop_rate: float | None = None

    @classmethod
    def of(cls, m: StepMetrics, *, time: float, step_s: float, gen_stats: Iterable[GeneratorStats],
           generators: int, evals: Iterable[EvalResult] = ()) -> StepRecord:
        gen_stats = list(gen_stats)
        drawn = sum(s.recent_drawn for s in gen_stats)
        return cls(m, time=round(time, 3), step_s=step_s,
                   gen_tokens_per_s=sum(s.tokens_per_s for s in gen_stats),
                   gen_totals=GeneratorTotals.of(gen_stats), generators=generators, evals=tuple(evals),
                   uniform_drop_rate=sum(s.recent_dropped for s in gen_stats) / drawn if drawn else None)

    @property
    def samples_per_s(self) -> float:
        return self.metrics.samples / self.step_s if self.step_s else 0.0

    @property
    def learner_tokens_per_s(self) -> float:
        """Response tokens the learner trained on per second of the step."""
        return self.metrics.tokens / self.step_s if self.step_s else 0.0

    @property
    def weight_sync_share(self) -> float:
        return self.metrics.weight_sync_s / self.step_s if self.step_s else 0.0

    def to_json(self) -> dict[str, Any]:
        v = self.metrics.version
        row = {"step": v, "policy_version": v, "time": self.time, "step_s": self.step_s,
               "samples_per_s": self.samples_per_s, "learner_tokens_per_s": self.learner_tokens_per_s,
               "weight_sync_share": self.weight_sync_share,
               "gen_tokens_per_s": self.gen_tokens_per_s, "gen_totals": dataclasses.asdict(self.gen_totals),
               "generators": self.generators, **self.metrics.to_json()}
        if self.evals:
            row["evals"] = [e.to_json() for e in self.evals]
        if self.uniform_drop_rate is not None:
            row["uniform_drop_rate"] = self.uniform_drop_rate
        return row

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> StepRecord:
        job = ("step", "policy_version", "time", "step_s", "samples_per_s", "learner_tokens_per_s", "weight_sync_share",
               "gen_tokens_per_s", "gen_totals", "generators", "evals", "uniform_drop_rate")
        return cls(StepMetrics.from_json({k: v for k, v in row.items() if k not in job}),
                   time=row["time"], step_s=row["step_s"], gen_tokens_per_s=row["gen_tokens_per_s"],
                   gen_totals=GeneratorTotals(**row["gen_totals"]), generators=row["generators"],
                   evals=tuple(EvalResult.from_json(e) for e in row.get("evals", ())),
                   uniform_drop_rate=row.get("uniform_drop_rate"))

    def scalars(self) -> dict[str, float]:
        """TensorBoard's tags and values: the row's numbers."""
        return {k: v for k, v in self.to_json().items() if isinstance(v, (int, float))}

    def console_line(self, steps: int) -> str:
        m, g = self.metrics, self.gen_totals
        line = (f"step {m.version:>4}/{steps}  reward {m.reward_mean:.3f}  loss {m.loss:+.4f}  "
                f"staleness max {m.staleness_max} mean {m.staleness_mean:.2f}  "
                f"{self.samples_per_s:.1f} samples/s  sync {m.weight_sync_s * 1000:.0f} ms  "
                f"gens {self.generators}  t {self.time:.0f}s")
        if g.episodes:
            line += f"  turns/episode {g.turns / g.episodes:.2f}"
        if self.uniform_drop_rate is not None:  # dynamic sampling: why steps slow, and its bound
            line += f"  uniform dropped {self.uniform_drop_rate:.0%}"
            line += f" ({g.admitted_uniform:.0f} admitted past the bound)" if g.admitted_uniform else ""
        return line


def completion_line(group: CompletionGroup, width: int = 48) -> str:
    """The console's glimpse of a step's completions: its first group's prompt and first response."""
    c = group.responses[0]
    adv = "" if c.advantage is None else f"  advantage {c.advantage:+.2f}"
    return (f"  sample v{group.step}: {group.prompt[-width:]!r} -> {c.response[:width]!r}  "
            f"reward {c.reward:.3f}{adv}  staleness {c.staleness}")


class MetricsLog:
    def __init__(self, out: Path, steps: int, wandb: WandbRun | None = None):
        # tensorboard's own event writer: torch.utils.tensorboard's SummaryWriter wraps it, and
        # would import torch into the launcher while the engines start (~2 CPU-s)
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.steps = steps  # the job's learner.steps, for the console line
        self.progress: Progress | None = None  # from the first step written: start-up is no step's time
        self.tb = EventFileWriter(str(out / "tensorboard"))
        self.jsonl = (out / "metrics.jsonl").open("a")  # a resumed job appends
        self.completions = (out / "completions.jsonl").open("a")
        self.wandb = wandb
        self.last_version = -1  # of the newest row written

    def step(self, record: StepRecord) -> None:
        version = record.metrics.version
        self.jsonl.write(json.dumps(record.to_json(), default=float) + "\n")
        self.jsonl.flush()
        self.last_version = version
        self._scalars(record.scalars(), version)
        groups = record.metrics.completions
        if self.wandb is not None:
            self.wandb.step(record.scalars(), groups)
        if self.progress is None:
            self.progress = Progress(self.steps - version + 1, "steps", start=time.monotonic() - record.step_s)
        bar = self.progress.bar(self.progress.total - (self.steps - version))
        print(record.console_line(self.steps) + (f"  {bar}" if bar else ""), flush=True)
        if groups:
            self._completions(groups, version)
            print(completion_line(groups[0]), flush=True)

    def _completions(self, groups: tuple[CompletionGroup, ...], version: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        for g in groups:
            self.completions.write(json.dumps(g.to_json(), default=float) + "\n")
        self.completions.flush()
        # TensorBoard's text plugin: a string tensor of Markdown, one table per step
        rows = ["| prompt | response | reward | advantage | staleness |", "| --- | --- | --- | --- | --- |"]
        rows += [f"| {_cell(g.prompt)} | {_cell(c.response)} | {c.reward:.3f} | "
                 f"{'' if c.advantage is None else f'{c.advantage:+.3f}'} | {c.staleness} |"
                 for g in groups for c in g.responses]
        tensor = TensorProto(dtype=7, string_val=["\n".join(rows).encode()],  # 7: DT_STRING
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        value = Summary.Value(tag="completions", metadata=meta, tensor=tensor)
        self.tb.add_event(Event(wall_time=time.time(), step=version, summary=Summary(value=[value])))

    def evaluation(self, e: EvalResult) -> None:
        self._scalars(e.scalars(), e.policy_version)
        if self.wandb is not None:
            self.wandb.evaluation(e.scalars(), e.policy_version)
        extra = f"  reward_sampled {e.reward_sampled:.3f}  pass@{e.samples} {e.pass_at_k:.3f}" if e.samples else ""
        print(f"eval v{e.policy_version:>4}  reward {e.reward:.3f} (greedy, {e.prompts} held-out "
              f"prompts){extra}  {e.seconds:.1f} s", flush=True)

    def _scalars(self, scalars: Mapping[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in scalars.items()]
        self.tb.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        self.jsonl.close()
        self.completions.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _cell(text: str) -> str:
    """`text` fit for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "\\n")
