"""The learning-rate schedule (learners/schedule.py) against numbers worked out by hand."""

import math

import pytest

from learners.schedule import lr_at


@pytest.mark.parametrize(
    "schedule, want",
    [
        # lr 1, 2 warmup steps, 6 steps: warmup 1/2, 2/2; then p = (s - 2) / 4 for s = 2..5
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),  # 1 - p
        # (1 + cos(pi p)) / 2 at p = 0, 1/4, 1/2, 3/4
        ("cosine", [0.5, 1.0, 1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2]),
    ],
)
def test_warmup_then_schedule_by_hand(schedule, want):
    got = [lr_at(s, lr=1.0, warmup=2, total=6, schedule=schedule) for s in range(6)]
    assert got == pytest.approx(want)


def test_no_warmup_starts_at_lr_and_decay_scales_with_it():
    assert lr_at(0, lr=3e-4, warmup=0, total=4, schedule="linear") == pytest.approx(3e-4)
    assert lr_at(2, lr=3e-4, warmup=0, total=4, schedule="linear") == pytest.approx(1.5e-4)
    want = 3e-4 * (1 - math.sqrt(0.5)) / 2  # p = 3/4
    assert lr_at(3, lr=3e-4, warmup=0, total=4, schedule="cosine") == pytest.approx(want)


def test_steps_past_the_run_stay_at_0_and_a_whole_run_of_warmup_ends_at_lr():
    # a run trained past learner.steps (train(steps=...)): the decay holds at 0, never turns back up
    past = [lr_at(s, lr=1.0, warmup=0, total=4, schedule=k) for s in (4, 9) for k in ("linear", "cosine")]
    assert past == [0.0] * 4
    assert lr_at(3, lr=1.0, warmup=4, total=4, schedule="linear") == 1.0
