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
        # evaluations arrive after the steps they evaluated: their own x axis
        self.run.define_metric("eval_policy_version")
        self.run.define_metric("eval_*", step_metric="eval_policy_version")
        self.rows: list[list] = []  # every completion shown so far: W&B tables are logged whole
        self.step = 0  # the newest step logged: W&B drops a row logged at an older one

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.step = step
        self.run.log(dict(scalars), step=step)

    def evaluation(self, scalars: Mapping[str, float], version: int) -> None:
        self.run.log({**scalars, "eval_policy_version": version}, step=self.step)

    def completions(self, groups: tuple[CompletionGroup, ...], step: int) -> None:
        self.rows += [[g.step, g.prompt, c.response, c.reward, str(dict(c.reward_parts)), c.advantage,
                       c.staleness, c.policy_version, c.tokens, c.finished]
                      for g in groups for c in g.responses]
        self.run.log({"completions": self.wandb.Table(columns=COLUMNS, data=self.rows)}, step=step)

    def finish(self) -> None:
        self.run.finish()
