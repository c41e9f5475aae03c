"""The bench harness on its own: a call in a child process, warm-up then time, the report files."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from async_rlhf.launch.bench.harness import Target, in_child, save, warm_then_time


def test_in_child_returns_what_the_function_returned_from_another_process(tmp_path: Path):
    assert in_child(math.hypot, 3.0, 4.0, log=tmp_path / "hypot.log") == 5.0
    assert in_child(os.getpid, log=tmp_path / "pid.log") != os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hypot.log", "pid.log"]  # no leftovers


def test_in_child_failure_names_the_log(tmp_path: Path):
    with pytest.raises(RuntimeError, match=r"sqrt failed in its own process \(exit 1\); see .*sqrt.log"):
        in_child(math.sqrt, -1.0, log=tmp_path / "sqrt.log")
    assert "math domain error" in (tmp_path / "sqrt.log").read_text()


def test_warm_then_time_times_only_the_calls_after_the_warm_up():
    calls = []
    timed = warm_then_time(lambda: calls.append(len(calls)) or len(calls), warmup=2, repeats=3)
    assert [value for _, value in timed] == [3, 4, 5] and all(s >= 0 for s, _ in timed)


@dataclass(frozen=True)
class _Report:
    rate: float
    verdicts: list


def test_save_writes_the_dataclass_as_json_and_the_files_beside_it(tmp_path: Path, capsys):
    report = _Report(2.5, [Target("x", "rate", "a", "b", at_least=2.0).judge(2.5)])
    save(report, tmp_path / "r" / "bench.json", markdown=lambda r, p: p.write_text(f"rate {r.rate}"),
         plot=lambda r, p: p.write_bytes(b"png"))
    data = json.loads((tmp_path / "r" / "bench.json").read_text())
    assert data["rate"] == 2.5 and data["verdicts"][0] == {
        "target": {"name": "x", "metric": "rate", "run": "a", "against": "b", "at_least": 2.0, "at_most": None},
        "value": 2.5, "met": True}
    assert (tmp_path / "r" / "bench.png").read_bytes() == b"png"
    assert "rate 2.5" in capsys.readouterr().out
