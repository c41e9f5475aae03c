"""What the learner reports about a batch's responses (learners/samples.py), on numbers worked
out by hand, and the completions it shows, as OUT/completions.jsonl, TensorBoard text and the
console's line hold them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from async_rlhf.launch.metrics import MetricsLog, StepRecord
from async_rlhf.types import Group, Received
from helpers import make_traj
from learners.samples import completion_groups, sample_stats
from test_messages import _gen, _step


def _items() -> list[Received]:
    """Two groups of two: rewards (1, 0) and (0.5, 0.5); responses of 4, 2, 4 and 4 tokens, the
    second cut at its limit and the third an episode whose tokens 1-2 an environment wrote."""
    a = (make_traj(0, reward=1.0, reward_parts={"correct": 1.0}, finished=True, policy_version=2),
         make_traj(1, reward=0.0, reward_parts={"correct": 0.0}, finished=False, policy_version=1,
                   response_ids=np.array([8, 9], dtype=np.int32),
                   behavior_logprobs=np.array([-0.5, -1.0], dtype=np.float32)))
    b = (make_traj(2, reward=0.5, reward_parts={"correct": 0.25, "length": 0.25}, finished=True,
                   policy_version=2, observation_spans=((1, 3),),
                   behavior_logprobs=np.array([-0.5, 0.0, 0.0, -1.0], dtype=np.float32)),
         make_traj(3, reward=0.5, reward_parts={"correct": 0.75, "length": -0.25}, finished=True, policy_version=2))
    return [Received("1-0", Group(a)), Received("2-0", Group(b))]


def test_sample_stats_of_a_batch():
    stats = sample_stats(_items())
    assert stats["response_len_mean"] == (4 + 2 + 2 + 4) / 4 and stats["response_len_max"] == 4
    assert stats["response_truncated_frac"] == 0.25
    assert stats["reward_group_std"] == pytest.approx((0.5 + 0.0) / 2)  # population std per group
    assert stats["groups_zero_adv_frac"] == 0.5
    assert stats["reward_parts"] == {"correct": 0.5, "length": 0.0}


def test_completions_carry_text_rewards_advantages_and_staleness():
    decode = lambda ids: "".join(chr(ord("a") + i % 26) for i in ids)  # noqa: E731 (pure logic)
    (group,) = completion_groups(_items(), step=3, groups=1, advantage="grpo", decode=decode)
    assert group.step == 3 and group.prompt == decode([5, 6, 7]) and group.generator_id == "gen-0"
    first, second = group.responses
    # GRPO on (1, 0): mean 0.5, unbiased std sqrt(0.5)
    assert first.advantage == pytest.approx(0.5 / 0.5**0.5, rel=1e-5) and second.advantage == pytest.approx(-first.advantage)
    assert (first.staleness, second.staleness) == (0, 1)  # version 3 was trained from version 2's weights
    assert (second.response, second.tokens, second.finished) == (decode([8, 9]), 2, False)
    assert first.reward_parts == {"correct": 1.0}
    (gae,) = completion_groups(_items(), step=3, groups=1, advantage="gae", decode=decode)
    assert {c.advantage for c in gae.responses} == {None}  # token-level: no one number per response


def test_completions_reach_the_jsonl_tensorboard_and_the_console(tmp_path, capsys):
    groups = completion_groups(_items(), step=3, groups=2, advantage="rloo", decode=lambda ids: f"t{ids[0]}|")
    log = MetricsLog(tmp_path, steps=3)
    for version in (2, 3):
        m = _step(version, completions=groups if version == 3 else ())
        log.step(StepRecord.of(m, time=1.0, step_s=1.0, gen_stats=[_gen()], generators=1))
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"], len(r["responses"])) for r in rows] == [(3, "t5|", 2), (3, "t7|", 2)]
    assert set(rows[0]["responses"][0]) == {"response", "reward", "reward_parts", "advantage",
                                            "policy_version", "staleness", "tokens", "finished"}
    assert rows[0]["responses"][1]["advantage"] == -1.0  # RLOO on (1, 0): 0 - 1
    assert "completions" not in (tmp_path / "metrics.jsonl").read_text()
    tb = EventAccumulator(str(tmp_path / "tensorboard"))
    tb.Reload()
    (event,) = tb.Tensors("completions")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "| t5\\| | t8\\| | 1.000 | +1.000 | 0 |" in text and "| 0.000 | -1.000 | 1 |" in text
    assert "  sample v3: 't5|' -> 't8|'  reward 1.000  advantage +1.00  staleness 0" in capsys.readouterr().out
