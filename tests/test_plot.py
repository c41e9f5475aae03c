"""What users read after a run: `async-rlhf plot` draws its rows, and docs/metrics.md explains
every name metrics.jsonl holds (glossary_misses is also run on real jobs' rows in test_job.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from matplotlib.figure import Figure

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
    with pytest.raises(SystemExit, match="holds no metrics.jsonl or trl.json: pass the --out directory of a train job"):
        main(["plot", str(tmp_path / "a" / "plots")])


def test_plot_overlays_trl_baseline_on_the_reward_figure(tmp_path, capsys, monkeypatch):
    _run(tmp_path / "ours", 0.2)
    steps = [{"step": 1, "t": 9.5, "reward": 0.1}, {"step": 2, "t": 12.0, "reward": 0.4},
             {"step": 3, "t": 14.5, "reward": 0.9}]
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "trl.json").write_text(json.dumps(  # as scripts/trl_baseline.py writes it
        {"config": "configs/bench.yaml", "bf16": True, "steps": steps, "samples_per_s": 25.6,
         "first_step_s": 9.5, "target": 0.9, "reward_target_s": 14.5, "train_wall_s": 5.0, "command_s": 15.1}))
    drawn: dict[str, list[list[tuple[str, list, list]]]] = {}  # figure -> per panel (label, x, y) of each line
    legends: dict[str, list[str]] = {}
    save = Figure.savefig

    def record_then_save(fig, path, **kwargs):  # the real save, after noting what the figure holds
        stem = Path(path).stem
        drawn[stem] = [[(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()]
                       for ax in fig.axes]
        legends[stem] = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        save(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record_then_save)
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "ours"), str(tmp_path / "trl"), "--out", str(tmp_path / "plots")]) == 0
    written = {Path(p).stem for p in capsys.readouterr().out.split()}
    assert (tmp_path / "plots" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trl = f"{tmp_path / 'trl'} (TRL GRPOTrainer, bf16) train (batch)"
    ours = f"{tmp_path / 'ours'} train (batch)"
    by_step, by_time = ({label: (x, y) for label, x, y in panel} for panel in drawn["reward"])
    assert by_step[trl] == ([1, 2, 3], [0.1, 0.4, 0.9])
    assert by_time[trl] == ([9.5, 12.0, 14.5], [0.1, 0.4, 0.9])  # seconds since the command
    assert by_time[ours] == ([2.0, 4.0, 6.0, 8.0], pytest.approx([0.2, 0.4, 0.6, 0.8]))
    assert {trl, ours} <= set(legends["reward"])
    # what TRL does not record has our curves alone; the stage times are ours (one column)
    assert written == {"reward", "kl", "entropy", "response_length", "staleness", "throughput", "stage_times"}
    for stem in written - {"reward"}:
        assert all("TRL" not in label for panel in drawn[stem] for label, _, _ in panel)
    assert len(drawn["stage_times"]) == 2


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
