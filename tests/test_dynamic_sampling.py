"""generator.max_draws_per_group's rule (actors/dynamic_sampling.py), as pure logic: which uniform
groups a generator drops, over its window of recent groups drawn."""

from __future__ import annotations

import logging
import random

import pytest

from actors.dynamic_sampling import WINDOW_PER_DRAW, DrawBound


def _decisions(bound: DrawBound, uniform: list[bool]) -> list[bool]:
    return [bound.drop(u) for u in uniform]


def test_a_solved_task_puts_one_group_in_max_draws_and_warns_once(caplog):
    """Every group uniform (a solved task): of each 4 drawn, 3 are dropped and the 4th goes on,
    so a step waits for at most 4x its batch; the first admission logs one warning naming the
    key and the measured rate."""
    bound = DrawBound(4, "gen-0")
    with caplog.at_level(logging.WARNING, logger="actors.dynamic_sampling"):
        drops = _decisions(bound, [True] * 400)
    assert drops[:8] == [True, True, True, False] * 2
    assert drops.count(False) == 100 and bound.counts[2] == 100  # admitted, since the start
    drawn, dropped, _ = bound.counts
    assert drawn == WINDOW_PER_DRAW * 4 and dropped == 3 * drawn // 4
    [warning] = caplog.records
    assert "gen-0: dynamic sampling dropped 3 of its last 3 groups drawn, past generator.max_draws_per_group=4" in (
        warning.getMessage())


def test_groups_with_a_signal_go_on_and_uniform_ones_drop_while_under_the_bound():
    """Half uniform (2 draws per group put, under 4): every uniform group is dropped, none
    admitted; a group with a signal is never dropped."""
    bound = DrawBound(4)
    drops = _decisions(bound, [True, False] * 100)
    assert drops == [True, False] * 100 and bound.counts[2] == 0


def test_dropping_resumes_once_the_rate_falls_back_under_the_bound():
    bound = DrawBound(4)
    _decisions(bound, [True] * 100)  # admitting one in 4
    assert _decisions(bound, [False] * 8) == [False] * 8
    assert _decisions(bound, [True] * 3) == [True] * 3  # the window's rate fell: uniform groups drop again


def test_one_draw_per_group_drops_nothing():
    assert _decisions(DrawBound(1), [True] * 20) == [False] * 20


@pytest.mark.parametrize("max_draws", [2, 4, 8])
def test_the_windows_drop_rate_never_passes_the_bound(max_draws):
    """Whatever mix of groups comes (a task being solved: more and more uniform ones), a window
    that is full has dropped at most 1 - 1/max_draws of its groups."""
    rng, bound = random.Random(max_draws), DrawBound(max_draws)
    for i in range(4000):
        bound.drop(rng.random() < i / 4000)
        drawn, dropped, _ = bound.counts
        assert drawn < WINDOW_PER_DRAW * max_draws or dropped * max_draws <= drawn * (max_draws - 1), (i, bound.counts)
    assert bound.counts[2] > 0


def test_a_bound_under_one_is_refused():
    with pytest.raises(ValueError, match=r"generator.max_draws_per_group must be >= 1, got 0"):
        DrawBound(0)
