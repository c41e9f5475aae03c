"""Dynamic sampling's bound (generator.max_draws_per_group): how many groups a generator may draw
(generate and score) per group it puts on the stream before it stops dropping uniform ones.

DAPO drops a group whose rewards are all equal and draws another. Once the policy solves (or
cannot yet score on) most prompts, nearly every group is uniform, and a step waits for many
times its batch in generation: unbounded, the job stalls. verl caps the generation batches a
step may draw (algorithm.filter_groups.max_num_gen_batches) and raises an error at the cap.
Here a generator instead admits uniform groups once its recent draws per group put would pass
the bound: they train with advantage 0 but fill the batch, so steps go on at the generation
rate, and dropping resumes as soon as the rate falls back under the bound.

The window is each generator's own last WINDOW_PER_DRAW * max_draws_per_group groups drawn
(put or dropped; groups set aside for a failed reward are neither): no state is shared
between generators, and as each one's draws stay within the bound, so do the job's.
"""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger(__name__)

WINDOW_PER_DRAW = 8  # the window holds this many times max_draws_per_group groups


class DrawBound:
    """The rule, fed one group drawn at a time (`drop`). Written by one thread; `counts` is safe
    to read from another (one tuple, replaced whole)."""

    def __init__(self, max_draws_per_group: int, name: str = ""):
        if max_draws_per_group < 1:
            raise ValueError(f"generator.max_draws_per_group must be >= 1, got {max_draws_per_group}")
        self.max_draws, self.name = max_draws_per_group, name
        self._window: deque[bool] = deque(maxlen=WINDOW_PER_DRAW * max_draws_per_group)  # True: dropped
        # the window's groups drawn and, of them, dropped; uniform groups admitted since the start
        self.counts = (0, 0, 0)

    def drop(self, uniform: bool) -> bool:
        """Whether the group just drawn is dropped: only a uniform one, and only if, dropped, the
        window would still have drawn fewer than max_draws groups per group put, counting the
        next one as put (drawn < max_draws * (put + 1)). With every group uniform, one in each
        max_draws goes on; a full window has dropped at most 1 - 1/max_draws of its groups."""
        drawn, dropped, admitted = self.counts
        evicted = drawn == self._window.maxlen and self._window[0]
        after, dropped_after = min(drawn + 1, self._window.maxlen), dropped + 1 - evicted
        drop = uniform and after < self.max_draws * (after - dropped_after + 1)
        if uniform and not drop and not admitted:
            log.warning("%s: dynamic sampling dropped %d of its last %d groups drawn, past generator."
                        "max_draws_per_group=%d drawn per group put: uniform groups now go on (advantage 0, "
                        "counted as admitted_uniform) while the rate stays past it. Most groups score alike "
                        "(the task is solved, or not yet learnt); raise the key to draw more per group.",
                        self.name, dropped, drawn, self.max_draws)
        self._window.append(drop)
        self.counts = (len(self._window), dropped + drop - evicted, admitted + (uniform and not drop))
        return drop
