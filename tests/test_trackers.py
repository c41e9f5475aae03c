"""Weights & Biases through the real wandb package, offline (no network): what the launcher's
metrics log sends, read back from the run's transaction log with wandb's own reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def wandb_history(out: Path, home: Path) -> list[dict]:
    """The history rows of the one W&B run under OUT/wandb, as `wandb leet inspect` reads them."""
    (run,) = (out / "wandb").glob("offline-run-*")
    wandb_cli = Path(sys.executable).with_name("wandb")
    done = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HOME": str(home)})
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


def test_the_metrics_log_sends_steps_evaluations_and_completions_to_wandb_without_torch(tmp_path):
    code = f"""
import sys
from pathlib import Path
from async_rlhf.config import load_config
from async_rlhf.launch.metrics import MetricsLog, StepRecord
from async_rlhf.launch.trackers import WandbRun
from async_rlhf.messages import Completion, CompletionGroup, EvalResult
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_messages import _gen, _step

def group(prompt):
    return CompletionGroup(step=3, prompt=prompt, generator_id="gen-0", responses=tuple(
        Completion(response=f"r{{i}}", reward=1.0 - i, reward_parts={{"correct": 1.0 - i}}, advantage=0.7 - 1.4 * i,
                   policy_version=2, staleness=0, tokens=4, finished=True) for i in (0, 1)))

out = Path({str(tmp_path)!r})
cfg = load_config(None, ["job=j", "log.wandb.project=p", "log.wandb.mode=offline"])
log = MetricsLog(out, 3, wandb=WandbRun(cfg, out))
for v in (1, 2, 3):
    if v == 3:
        log.evaluation(EvalResult(2, 0.25, 6, 0, 1.5))
    shown = (group("p0"), group("p1")) if v == 3 else ()
    log.step(StepRecord.of(_step(v, completions=shown), time=v, step_s=1.0, gen_stats=[_gen()], generators=1))
log.close()
print([m for m in ("torch", "vllm", "transformers") if m in sys.modules])
"""
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"  # the launcher's process stays free of torch
    history = wandb_history(tmp_path, tmp_path / "home")
    steps = [h for h in history if "step" in h]  # a row per learner step, one per evaluation
    assert [h["step"] for h in steps] == [1, 2, 3] and [h["loss"] for h in steps] == [0.25] * 3
    assert all("samples_per_s" in h and "eval_reward" not in h for h in steps)
    (evaluation,) = [h for h in history if "eval_reward" in h]
    assert evaluation["eval_reward"] == 0.25 and evaluation["eval_policy_version"] == 2
    assert steps[2]["completions.nrows"] == 4 and steps[2]["completions.ncols"] == 10
    (table,) = (tmp_path / "wandb").glob("offline-run-*/files/" + steps[2]["completions.path"])
    rows = json.loads(table.read_text())
    assert rows["columns"][:3] == ["step", "prompt", "response"] and rows["data"][0][:4] == [3, "p0", "r0", 1.0]
