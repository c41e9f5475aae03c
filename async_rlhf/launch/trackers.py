"""Weights & Biases for a job (log.wandb): the step scalars TensorBoard gets, held-out
evaluations against the version they evaluated, and the completions as one growing table. The
`wandb` package is imported here only, and only a job with log.wandb.project imports this module."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from async_rlhf.config import Config
from async_rlhf.messages import CompletionGroup

COLUMNS = ["step", "prompt", "response", "reward", "reward_parts", "advantage", "staleness",
           "policy_version", "tokens", "finished"]


def wandb_missing() -> str:
    return ("log.wandb.project is set but the wandb package is not installed: "
            'pip install -e ".[wandb]" (or pip install wandb), or unset log.wandb.project')


class WandbRun:
    """One W&B run for the job, its files under OUT/wandb (offline: only there)."""

    def __init__(self, cfg: Config, out: Path):
        try:
            import wandb
        except ImportError:
            raise ImportError(wandb_missing()) from None
        w = cfg.log.wandb
        self.wandb = wandb
        self.run = wandb.init(project=w.project, entity=w.entity or None, name=w.name or cfg.job, mode=w.mode,
                              dir=str(out), config=yaml.safe_load(cfg.to_yaml()), job_type="train")
        self.rows: list[list] = []  # every completion shown so far: W&B tables are logged whole
        self.axes: dict[str, str] = {}  # key -> the key it is plotted against

    def _against(self, keys, axis: str) -> None:
        """Plot `keys` against `axis`, not W&B's own row counter: a row per learner step and one
        per evaluation, which arrives after the steps that followed the version it evaluated."""
        for key in set(keys) - set(self.axes) - {axis}:
            self.run.define_metric(key, step_metric=axis)
            self.axes[key] = axis

    def step(self, scalars: Mapping[str, float], completions: tuple[CompletionGroup, ...] = ()) -> None:
        """A learner step's row (`step` is the version it made), with the completions table
        when it shows some."""
        row: dict = dict(scalars)
        if completions:
            self.rows += [[g.step, g.prompt, c.response, c.reward, str(dict(c.reward_parts)), c.advantage,
                           c.staleness, c.policy_version, c.tokens, c.finished]
                          for g in completions for c in g.responses]
            row["completions"] = self.wandb.Table(columns=COLUMNS, data=self.rows)
        self._against(row, "step")
        self.run.log(row)

    def evaluation(self, scalars: Mapping[str, float], version: int) -> None:
        row = {**scalars, "eval_policy_version": version}
        self._against(row, "eval_policy_version")
        self.run.log(row)

    def finish(self) -> None:
        self.run.finish()
