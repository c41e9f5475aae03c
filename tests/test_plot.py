"""What users read after a run: `async-rlhf plot` draws its rows, and docs/metrics.md explains
every name metrics.jsonl holds (glossary_misses is also run on real jobs' rows in test_job.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from async_rlhf.launch.cli import main
from async_rlhf.launch.metrics import MetricsLog, StepRecord
from async_rlhf.launch.progress import Progress, eta_text
from async_rlhf.messages import EvalResult
from test_messages import _gen, _step

GLOSSARY = Path(__file__).parents[1] / "docs" / "metrics.md"


def glossary_misses(rows: list[dict]) -> set[str]:
    """The names in `rows` (metrics.jsonl rows; gen_totals.<field> and each evaluation's keys
    too) that docs/metrics.md's glossary does not explain; a `<name>` in the glossary stands for
    any text."""
    text = GLOSSARY.read_text().split("## Coming from")[0]
    names = {n for line in text.splitlines() if line.startswith("| `") for n in re.findall(r"`([^`]+)`", line)}
    patterns = [re.compile("^" + re.sub(r"<[^>]+>", ".+", re.escape(n).replace(r"\<", "<").replace(r"\>", ">")) + "$")
                for n in names]
    keys = {k for row in rows for k in row}
    keys |= {f"gen_totals.{k}" for row in rows for k in row.get("gen_totals", {})}
    keys |= {k for row in rows for e in row.get("evals", []) for k in e}
    return {k for k in keys if not any(p.match(k) for p in patterns)}


def _run(path: Path, reward: float) -> None:
    log = MetricsLog(path, steps=4)
    for v in range(1, 5):
        m = _step(v, reward_mean=reward * v, reward_parts={"actors.tasks:score": reward * v},
                  response_len_mean=3.0 + v, response_len_max=8)
        gen = _gen(generate_s=6.0 * v, idle_s=3.0 * v, tokens=480 * v)
        log.step(StepRecord.of(m, time=2.0 * v, step_s=2.0, gen_stats=[gen], generators=1,
                               evals=[EvalResult(v - 1, reward, 6, 0, 1.0, samples=2, reward_sampled=reward,
                                                 pass_at_k=0.5)] if v % 2 else []))
    log.close()


def test_plot_overlays_runs_into_titled_pngs(tmp_path, capsys):
    for name, reward in (("a", 0.1), ("b", 0.2)):
        _run(tmp_path / name, reward)
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b")]) == 0  # into the first run's plots/
    written = capsys.readouterr().out.split()
    assert {Path(p).parent for p in written} == {tmp_path / "a" / "plots"}
    names = {"reward", "kl", "entropy", "response_length", "staleness", "throughput", "stage_times"}
    assert {Path(p).stem for p in written} == names
    for p in written:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(p).stat().st_size > 20_000
    with pytest.raises(SystemExit, match="holds no metrics.jsonl: pass the --out directory of a train job"):
        main(["plot", str(tmp_path / "a" / "plots")])


def test_the_glossary_explains_every_name_a_row_holds(tmp_path):
    _run(tmp_path, 0.5)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert glossary_misses(rows) == set()
    # a name the glossary lacks is found (a field added without its line in docs/metrics.md)
    assert glossary_misses([{**rows[0], "new_metric": 1.0}]) == {"new_metric"}
    # every StepMetrics field is in a row (completions go to completions.jsonl instead)
    fields = {f.name for f in dataclasses.fields(_step(1))} - {"times", "counts", "extra", "reward_parts", "completions"}
    assert fields <= set(rows[0])


def test_progress_bar_and_eta_only_on_a_terminal():
    bar = Progress(60, "steps", start=100.0, shown=True)
    assert bar.bar(15, now=130.0) == "[#####...............] 15/60 steps, eta 1m30s"  # 2 s a step, 45 to go
    assert bar.bar(60, now=220.0) == "[####################] 60/60 steps"
    assert eta_text(3725) == "1h02m" and eta_text(42.4) == "42s"
    assert Progress(60, "steps", shown=False).bar(15) == ""  # a log file or pipe: the plain lines only
