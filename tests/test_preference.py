"""learner.algorithm dpo and rs: which rows of a batch they train (pure), and the learner loop
on the torch backend, the tiny model and the real Redis stream (conftest.py make_learner); the
offline producer of data.source=preferences on the real stream."""

import dataclasses
import math
import threading
import time

import torch
from helpers import VOCAB, EngineGate

from async_rlhf.synthetic import random_groups
from async_rlhf.types import Group, Received
from async_rlhf.weight_sync import UpdateMeta
from learners.batch import Batch
from learners.losses import sequence_logprob
from learners.preference import CHOSEN, REJECTED, best_of_group_roles, preference_roles


def test_pairs_take_each_groups_first_best_and_first_worst_and_count_ties():
    rewards = torch.tensor([0.5, 1.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3, 0.2, 0.1, 0.1, 0.9])
    groups = torch.arange(3).repeat_interleave(4)
    roles, tied = preference_roles(rewards, groups)
    assert roles.tolist() == [0, CHOSEN, REJECTED, 0, 0, 0, 0, 0, 0, REJECTED, 0, CHOSEN]
    assert tied == 1


def test_best_of_group_keeps_a_groups_best_only_at_the_threshold_or_above():
    rewards = torch.tensor([0.5, 0.75, 0.75, 0.2, 0.4, 0.1])
    groups = torch.arange(3).repeat_interleave(2)
    roles, below = best_of_group_roles(rewards, groups, threshold=0.5)
    assert roles.tolist() == [0, CHOSEN, CHOSEN, 0, 0, 0] and below == 1


def _with_rewards(group: Group, *rewards: float) -> Group:
    return Group(tuple(dataclasses.replace(t, reward=r) for t, r in zip(group.members, rewards)))


def _sequence_logps(learner, groups, *, reference=False) -> torch.Tensor:
    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(groups)])
    with torch.no_grad():
        logp = learner.backend.logprobs(batch.input_ids, batch.attention_mask, batch.positions,
                                        reference=reference)[0]
    return sequence_logprob(logp, batch.mask)


def test_online_dpo_prefers_each_groups_best_over_its_worst_against_a_frozen_reference(make_learner):
    """Group 0 has a pair (best row 0, worst row 1); group 1's rewards are all equal: no pair,
    counted. The policy's log-ratio of best over worst rises, the reference stays, and the
    stats say so; every group is acked as trained whether or not it held a pair."""
    g0, g1 = random_groups(2, vocab=VOCAB, seed=3)
    fixed = [_with_rewards(g0, 1.0, 0.0, 0.5, 0.5), _with_rewards(g1, 0.5, 0.5, 0.5, 0.5)]
    learner, queue, _ = make_learner(algorithm="dpo", dpo_beta=0.5)
    before, ref_before = _sequence_logps(learner, fixed), _sequence_logps(learner, fixed, reference=True)
    history = []
    for _ in range(4):
        queue.put([g.with_version(learner.version, f"{g.group_id}@v{learner.version}") for g in fixed])
        history.append(learner.step())
    after, ref_after = _sequence_logps(learner, fixed), _sequence_logps(learner, fixed, reference=True)
    assert torch.equal(ref_before, ref_after)
    assert (after[0] - after[1]) - (before[0] - before[1]) > 1.0, (before, after)
    last = history[-1]
    assert last.extra["pairs"] == 1 and last.extra["pair_accuracy"] == 1.0
    assert last.extra["reward_margin"] > 0.5 * 1.0
    assert last.extra["chosen_logratio"] > 0 > last.extra["rejected_logratio"]
    assert last.counts["groups_no_pair"] == 4 and math.isnan(last.clip_frac)
    assert 0.0 <= last.extra["pad_share"] < 1.0  # the learner's own stats beside the objective's
    assert [m.loss for m in history] == sorted((m.loss for m in history), reverse=True)
    assert queue.stats().counters["trained"] == 8  # groups, the tied ones too


def test_rejection_sampling_fine_tunes_on_each_groups_best_at_the_threshold(make_learner):
    """Group 0's best (row 2, reward 1.0) is trained on; group 1's best (0.25) is under
    rs_threshold=0.5 and counted. The best response's log-prob rises, its group's others less."""
    g0, g1 = random_groups(2, vocab=VOCAB, seed=4)
    fixed = [_with_rewards(g0, 0.0, 0.5, 1.0, 0.0), _with_rewards(g1, 0.25, 0.0, 0.0, 0.0)]
    learner, queue, _ = make_learner(algorithm="rs", rs_threshold=0.5)
    before = _sequence_logps(learner, fixed)
    for _ in range(3):
        queue.put([g.with_version(learner.version, f"{g.group_id}@v{learner.version}") for g in fixed])
        metrics = learner.step()
    rise = _sequence_logps(learner, fixed) - before
    assert rise[2] > 5.0 and rise[2] > 2 * rise[[0, 1, 3]].max(), rise
    assert metrics.extra["best_trained"] == 1 and metrics.counts["groups_below_threshold"] == 3


def _wait(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_preference_records_become_pairs_at_the_gate_and_bad_ones_are_dead_lettered_once(
        make_queue, tiny_actor_model):
    """Two good records among six bad ones: pairs (chosen reward 1, rejected 0, EOS-ended) enter
    the real stream as far as the staleness gate admits them, stamped with the version heard
    last; each bad record is dead-lettered with its reason once, not again in the next epoch."""
    from transformers import AutoTokenizer

    from actors.preferences import PreferenceProducer
    from actors.prompts import ChatRenderer
    from async_rlhf.staleness import StalenessGate

    tok = AutoTokenizer.from_pretrained(tiny_actor_model)
    rows = [{"prompt": "count a: 1=", "chosen": "aaaa", "rejected": "bb"},
            {"prompt": "count a: 2=", "rejected": "bb"},
            {"prompt": "count a: 3=", "chosen": " ", "rejected": "bb"},
            {"prompt": "count a: 4=", "chosen": "ab", "rejected": "ab"},
            {"chosen": "a", "rejected": "b"},
            {"prompt": "count a: 5=", "chosen": 3, "rejected": "b"},
            {"prompt": "count a: 6=", "chosen": "aaa", "rejected": "a"},
            {"prompt": "count a: 7=", "chosen": "a" * 50, "rejected": "b"}]
    queue = make_queue("gen-0")
    gate = StalenessGate(max_staleness=0, batch_size=4)  # 4 samples, 2 pairs, per version
    producer = PreferenceProducer(rows, ChatRenderer(tok), tok, queue,
                                  EngineGate(gate, lambda: producer.policy_version), max_tokens=40)
    stop = threading.Event()
    thread = threading.Thread(target=producer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        _wait(lambda: queue.stats().backlog == 2 and gate.running == 0, "two pairs")
        time.sleep(0.3)
        assert queue.stats().backlog == 2  # the gate holds the rest back
        gate.step_trained(4)
        producer.apply_weights(lambda: producer.engine.receive_weights(UpdateMeta(1, 1, []), load=True))
        _wait(lambda: queue.stats().backlog == 4, "two more pairs at version 1")
    finally:
        stop.set()
        thread.join(10)
    groups = [r.group for r in queue.get(10, block_ms=0)]
    assert [g.policy_version for g in groups] == [0, 0, 1, 1]
    assert [[t.reward for t in g.members] for g in groups] == [[1.0, 0.0]] * 4
    chosen = groups[0].members[0]
    assert chosen.response_ids.tolist() == tok("aaaa", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert chosen.prompt_ids.tolist() == tok("count a: 1=")["input_ids"]
    assert groups[2].members[0].prompt_ids.tolist() == chosen.prompt_ids.tolist()  # the next epoch
    reasons = [d.reason for d in queue.dead_letters()]
    assert reasons == ["missing_field", "empty_response", "identical_responses", "missing_field", "not_text",
                       "too_long"]
    # the last put: the second epoch's record 6, the 15th record read
    assert producer.stats().set_aside_total == 6 and queue.prompt_positions()["gen-0"] == 15


def test_ipo_with_length_normalised_log_probs_drives_the_margin_to_its_target(make_learner):
    """IPO regresses h (here per-token mean log-ratios) on 1 / (2 beta) = 1: the margin beta h
    goes to 0.5 from 0 and stays there, where DPO's would keep growing."""
    g0, g1 = random_groups(2, vocab=VOCAB, seed=5)
    fixed = [_with_rewards(g0, 1.0, 0.0, 0.5, 0.5), _with_rewards(g1, 0.0, 0.2, 0.9, 0.1)]
    learner, queue, _ = make_learner(algorithm="dpo", dpo_loss="ipo", dpo_beta=0.5, dpo_length_norm=True,
                                     lr=1e-3)
    margins = []
    for _ in range(8):
        queue.put([g.with_version(learner.version, f"{g.group_id}@v{learner.version}") for g in fixed])
        margins.append(learner.step().extra["reward_margin"])
    assert abs(margins[0]) < 1e-3 and abs(margins[-1] - 0.5) < 0.1, margins  # the reference in bf16 where autocast is (learner.reference_dtype auto)


def test_dpo_keeps_each_group_whole_in_a_micro_batch_whatever_its_rows_lengths(make_learner):
    """The learner orders a rank's rows longest first; for dpo it orders whole groups (by their
    longest row), so that group 0's long chosen row and its short rejected row still meet in one
    micro-batch of 4, and both pairs train."""
    g0, g1 = random_groups(2, vocab=VOCAB, seed=6)
    members = list(g0.members)
    for i, n in enumerate((8, 2, 2, 2)):  # g1's rows all have 8 tokens: row by row they would interleave
        t = members[i]
        members[i] = dataclasses.replace(t, response_ids=t.response_ids[:n], behavior_logprobs=t.behavior_logprobs[:n])
    fixed = [_with_rewards(Group(tuple(members)), 1.0, 0.0, 0.5, 0.5), _with_rewards(g1, 0.0, 1.0, 0.5, 0.5)]
    learner, queue, _ = make_learner(algorithm="dpo")
    queue.put(fixed)
    metrics = learner.step()
    assert metrics.extra["pairs"] == 2 and math.isfinite(metrics.loss)
