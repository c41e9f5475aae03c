"""The learner loop on the single-process torch backend (no DeepSpeed, no process group), on the
tiny model, fed by the real Redis experience stream (a fresh stream per test) and the real
staleness replay buffer: what a step trains, acks, drops and rejects, and checkpoints.
DeepSpeed's own behaviour (ZeRO stages, bf16, ranks, its checkpoints) is in test_learner_train.py
and test_learner_dist.py."""

import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest
import torch
from helpers import VOCAB, check_nonfinite_step_is_skipped, make_group

from async_rlhf.config import LearnerConfig
from async_rlhf.synthetic import random_groups
from async_rlhf.types import Group, Received
from buffer.codec import decode
from learners.advantages import grpo_advantages
from learners.batch import Batch, token_staleness
from learners.checkpoints import checkpoint_version
from learners.losses import policy_loss
from learners.models import load_models, response_logprobs


def test_fixed_batch_objective_decreases_and_metrics_are_complete(make_learner):
    fixed = random_groups(2, vocab=VOCAB, seed=3)
    learner, queue, publisher = make_learner(temperature=0.7, mixed_precision="fp32")
    be = learner.backend
    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(fixed)])
    args = (batch.input_ids, batch.attention_mask, batch.positions)
    with torch.no_grad():
        prox0 = be.logprobs(*args)[0]
        # the learner's log-probs are those of softmax(logits / temperature)
        logits = be.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        direct = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        assert torch.allclose(prox0, direct.gather(1, batch.positions), atol=1e-6)
    adv = grpo_advantages(batch.rewards, batch.groups)[:, None] * batch.mask

    def objective():  # the batch's (unclipped) surrogate loss against the initial pi_prox
        with torch.no_grad():
            logp = be.logprobs(*args)[0]
            return policy_loss(logp, prox0, batch.behavior_logp, adv, batch.mask, clip_eps=1e3)[0].item()

    values = [objective()]
    for _ in range(4):  # the same batch put again each step, stamped fresh so it is not stale
        v = learner.version  # (and with new group ids: the learner refuses copies of a group)
        queue.put([g.with_version(v, f"{g.group_id}@v{v}") for g in fixed])
        metrics = learner.step()
        values.append(objective())
    assert values[-1] < values[0] - 0.05, values
    assert all(b < a for a, b in zip(values, values[1:])), values

    assert learner.version == 4 and publisher.versions == [1, 2, 3, 4]
    assert set(publisher.weights) == {n for n, _ in be.model.named_parameters()}
    stats = queue.stats()
    assert stats.counters == {"produced": 8, "trained": 8} and stats.pending == stats.backlog == 0  # groups
    assert metrics.samples == 8 and metrics.tokens == 64 and math.isfinite(metrics.grad_norm)
    assert metrics.groups == 2 and metrics.group_size_min == 4 and metrics.groups_singleton == 0
    assert metrics.counts["groups"] == 8 and metrics.counts["samples"] == 32


def test_mixed_precision_computes_in_bf16_and_keeps_float32_weights(make_learner):
    """learner.mixed_precision=bf16: forward passes under bf16 autocast (log-probs close to the
    float32 ones, not equal), while weights, their gradients and AdamW's state stay float32."""
    fixed = random_groups(2, vocab=VOCAB, seed=3)
    learner, queue, _ = make_learner(mixed_precision="bf16")
    be = learner.backend
    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(fixed)])
    args = (batch.input_ids, batch.attention_mask, batch.positions)
    with torch.no_grad():
        mixed = be.logprobs(*args)[0]
        be.autocast = None
        exact = be.logprobs(*args)[0]
        be.autocast = torch.bfloat16
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, exact)
    assert (mixed - exact).abs().max() < 0.05
    queue.put([g.with_version(0) for g in fixed])
    metrics = learner.step()
    assert math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)
    assert {p.dtype for p in be.model.parameters()} == {torch.float32}
    states = be._optimizers["policy"].state.values()
    assert states and {s["exp_avg"].dtype for s in states} == {torch.float32}


def test_short_rows_attend_with_the_math_kernel_to_the_flash_kernels_log_probs_and_gradients(make_learner,
                                                                                             monkeypatch):
    """Rows up to MATH_ATTENTION_TOKENS long run SDPA's math kernel on CPU (faster there for
    short rows): log-probs and gradients agree with the flash kernel's, in float32."""
    import learners.models as models

    learner, _, _ = make_learner(mixed_precision="fp32")
    be = learner.backend
    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(random_groups(2, vocab=VOCAB, seed=4))])
    assert batch.input_ids.shape[1] <= models.MATH_ATTENTION_TOKENS
    results = []
    for limit in (models.MATH_ATTENTION_TOKENS, 0):  # the math kernel, then the flash one
        monkeypatch.setattr(models, "MATH_ATTENTION_TOKENS", limit)
        with torch.profiler.profile() as prof:
            logp = be.logprobs(batch.input_ids, batch.attention_mask, batch.positions)[0]
        flash = any("flash_attention" in e.name for e in prof.events())
        grads = torch.autograd.grad((logp * batch.mask).sum(), list(be.model.parameters()))
        results.append((flash, logp.detach(), grads))
    (math_flash, math_logp, math_grads), (flash, flash_logp, flash_grads) = results
    assert not math_flash and flash
    assert torch.allclose(math_logp, flash_logp, atol=1e-5)
    for a, b in zip(math_grads, flash_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), float((a - b).abs().max())


@pytest.mark.parametrize("packing, loss_agg", [(False, "token_mean"), (True, "token_mean"),
                                               (True, "seq_mean_token_mean"), (True, "seq_mean_token_sum")])
def test_micro_batches_of_like_length_unpadded_give_the_whole_padded_batch_gradient(make_learner, packing,
                                                                                    loss_agg):
    """The learner sorts a rank's rows by length and cuts each micro-batch to its longest row
    (Batch.trimmed), and packs its rows end to end (learner.packing): in float32 the summed
    gradient is that of the whole padded batch's loss, for every loss aggregation, with
    observation tokens (episodes) in some rows; packed, no position computed is padding."""
    members = [t for g in random_groups(2, vocab=VOCAB, seed=6) for t in g.members]
    members = [dataclasses.replace(t, prompt_ids=t.prompt_ids[:2 + i % 5], response_ids=t.response_ids[:1 + 3 * i % 8],
                                   behavior_logprobs=t.behavior_logprobs[:1 + 3 * i % 8],
                                   observation_spans=((1, 3),) if 1 + 3 * i % 8 > 3 and i % 2 else ())
               for i, t in enumerate(members)]  # prompts of 2-6 tokens, responses of 1-8
    groups = [Group(tuple(members[:4])), Group(tuple(members[4:]))]
    learner, queue, _ = make_learner(groups, mixed_precision="fp32", micro_batch=2, packing=packing,
                                     loss_agg=loss_agg)
    be = learner.backend
    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(groups)])
    assert batch.mask.eq(0).any()  # observation tokens
    logp = response_logprobs(be.model, batch.input_ids, batch.attention_mask, batch.positions, 1.0)[0]  # padded
    adv = grpo_advantages(batch.rewards, batch.groups)[:, None] * batch.mask
    loss = policy_loss(logp, logp.detach(), batch.behavior_logp, adv, batch.mask, agg=loss_agg,
                       num_tokens=float(batch.mask.sum()), num_seqs=8.0)[0]
    want = torch.autograd.grad(loss, list(be.model.parameters()))
    summed = []  # the gradient accumulated over the micro-batches, in place of AdamW's step
    be.step = lambda critic=False: summed.append([p.grad.clone() for p in be.model.parameters()]) or 1.0
    metrics = learner.step()
    assert len(summed) == 4  # 8 rows in micro-batches of 2
    for got, ref in zip(summed[-1], want):
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-7), float((got - ref).abs().max())
    # pad_share: each micro-batch computes its 2 rows x its longest row's tokens, or packed, its tokens
    lengths = sorted(batch.attention_mask.sum(1).tolist(), reverse=True)
    computed = sum(2 * lengths[i] for i in range(0, 8, 2))
    assert metrics.extra["pad_share"] == (0.0 if packing else pytest.approx(1 - sum(lengths) / computed))
    assert packing or 0 < metrics.extra["pad_share"] < 0.5


def test_a_model_whose_attention_mixes_packed_rows_trains_padded(make_learner, monkeypatch, caplog):
    """learner.packing is checked on the model at its first forward: where its masks ignore packed
    position ids (here transformers' detection is switched off), rows would attend across each
    other; the learner trains padded instead and says so."""
    import transformers.masking_utils

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    learner, _, _ = make_learner(random_groups(2, vocab=VOCAB, seed=3), mixed_precision="fp32", micro_batch=2)
    with caplog.at_level("WARNING", logger="learners.models"):
        learner.step()
    assert "mixes packed rows; training on padded rows" in caplog.text
    assert learner.backend._packing is False


def test_observation_tokens_carry_mask_0_and_never_reach_the_loss(make_learner):
    """Episodes: the tokens an environment wrote (observation_spans) condition the tokens after
    them but are never trained on. The learner's gradient is that of a loss whose mask is 0
    there, and it does not change whatever behaviour log-probs those tokens carry (were they in
    the loss, -30 would swing their importance weights to the cap)."""
    spans = ((2, 4),)  # tokens 2 and 3 of every 8-token response: the last ones stay sampled
    groups = [Group(tuple(dataclasses.replace(t, observation_spans=spans) for t in g.members))
              for g in random_groups(2, vocab=VOCAB, seed=7)]
    batch = Batch.from_received([Received(str(i), g) for i, g in enumerate(groups)])
    assert batch.mask[:, 2:4].eq(0).all() and batch.mask[:, [0, 1, 4, 7]].eq(1).all()
    assert batch.trimmed().mask.shape[1] == 8  # cut after the last sampled token, not at the mask's sum

    def gradient(groups):
        learner, _, _ = make_learner(groups, mixed_precision="fp32", micro_batch=8)
        be, summed = learner.backend, []
        be.step = lambda critic=False: summed.append([p.grad.clone() for p in be.model.parameters()]) or 1.0
        learner.step()
        return learner, summed[-1]

    learner, got = gradient(groups)
    be = learner.backend
    logp = be.logprobs(batch.input_ids, batch.attention_mask, batch.positions)[0]
    adv = grpo_advantages(batch.rewards, batch.groups)[:, None] * batch.mask
    loss = policy_loss(logp, logp.detach(), batch.behavior_logp, adv, batch.mask,
                       num_tokens=float(batch.mask.sum()), num_seqs=8.0)[0]
    want = torch.autograd.grad(loss, list(be.model.parameters()))
    odd = [Group(tuple(dataclasses.replace(t, behavior_logprobs=np.where(t.loss_mask(), t.behavior_logprobs, -30.0)
                                           .astype(np.float32), group_id=f"{t.group_id}-odd")
                       for t in g.members)) for g in groups]  # another id: not refused as a duplicate
    _, other = gradient(odd)
    for a, b, ref in zip(got, other, want):
        assert torch.equal(a, b)
        assert torch.allclose(a, ref, rtol=1e-4, atol=1e-7), float((a - ref).abs().max())


def with_member(group: Group, index: int, **changes) -> Group:
    """`group` with member `index` changed."""
    members = list(group.members)
    members[index] = dataclasses.replace(members[index], **changes)
    return Group(tuple(members))


def test_stale_and_malformed_groups_are_acked_with_a_reason_not_trained(make_learner):
    fresh = random_groups(2, vocab=VOCAB, version=3, seed=1)
    bad = random_groups(3, vocab=VOCAB, version=3, seed=4)
    bad_logp = with_member(bad[0], 1, behavior_logprobs=np.full(8, np.nan, np.float32))
    bad_reward = with_member(bad[1], 2, reward=float("inf"))
    bad_token = with_member(bad[2], 3, response_ids=np.full(8, VOCAB, np.int32))
    stale = random_groups(1, vocab=VOCAB, version=1, seed=2)  # 3 - 1 = 2 > k = 1
    learner, queue, _ = make_learner(stale + [bad_logp, bad_reward, bad_token] + fresh, max_staleness=1)
    learner.version = 3
    metrics = learner.step()
    # NaN/inf fail validation as the stream decodes them: dead-lettered there, with their reason;
    # a token id outside the vocabulary is valid on the wire: the learner rejects it to the same
    # dead-letter stream, with its bytes. Each one takes its whole group along (counts are groups).
    stats = queue.stats()
    assert stats.counters == {"produced": 6, "dropped_stale": 1, "trained": 2, "dead_lettered": 3}
    assert stats.pending == stats.backlog == 0
    dead = {d.reason: d for d in queue.dead_letters()}
    assert sorted(dead) == ["non_finite_logprob", "non_finite_reward", "token_id"]
    back = decode(dead["token_id"].raw)
    assert back.size == 4 and np.array_equal(back.members[3].response_ids, bad_token.members[3].response_ids)
    assert metrics.counts["dropped_stale"] == 1 and metrics.counts["rejected_token_id"] == 1
    assert metrics.staleness_hist == {0: 8}
    mean_reward = sum(t.reward for g in fresh for t in g.members) / 8
    assert metrics.reward_by_version == {3: (8, pytest.approx(mean_reward, abs=1e-6))}
    assert math.isfinite(metrics.loss)


def test_batches_hold_only_whole_groups_around_rejected_ones(make_learner):
    """Groups dead-lettered (at decode, or rejected by the learner: a bad token, a group of the
    wrong size) between good ones never shift group boundaries: every batch is whole groups."""
    good = random_groups(4, vocab=VOCAB, seed=6)
    bad = random_groups(3, vocab=VOCAB, seed=7)
    short = Group(bad[0].members[:3])  # a producer that split a group
    bad_token = with_member(bad[1], 0, response_ids=np.full(8, VOCAB, np.int32))
    bad_reward = with_member(bad[2], 2, reward=float("nan"))
    learner, queue, _ = make_learner([good[0], bad_token, short, bad_reward, *good[1:]])
    history = [learner.step(), learner.step()]
    for metrics in history:
        assert (metrics.samples, metrics.groups, metrics.group_size_min) == (8, 2, 4)
        assert metrics.groups_singleton == 0
    assert history[-1].counts["rejected_group_size"] == 1 and history[-1].counts["rejected_token_id"] == 1
    stats = queue.stats()
    assert stats.counters == {"produced": 7, "trained": 4, "dead_lettered": 3}
    assert stats.pending == stats.backlog == 0
    dead = {d.reason: d.raw for d in queue.dead_letters()}
    assert sorted(dead) == ["group_size", "non_finite_reward", "token_id"]
    assert decode(dead["group_size"]).size == 3 and decode(dead["token_id"]).size == 4 == len(
        msgpack.unpackb(dead["non_finite_reward"])["members"])


def test_a_copy_of_a_group_is_acked_as_duplicate_not_trained(make_learner):
    """A producer that puts a group twice (as one without the exactly-once put would): the
    learner trains the first entry and acks the copy as `duplicate`; a restarted learner still
    knows the id (the stream keeps it), and the accounting closes with lost = 0."""
    groups = random_groups(4, vocab=VOCAB, seed=11)
    learner, queue, _ = make_learner([groups[0], groups[0], groups[1]])  # the copy in one read
    metrics = learner.step()
    assert (metrics.samples, metrics.groups, metrics.counts["duplicate"]) == (8, 2, 1)
    restarted, queue, _ = make_learner([groups[0], groups[2], groups[3]])  # a copy of a trained one
    metrics = restarted.step()
    assert (metrics.samples, metrics.groups, metrics.counts["duplicate"]) == (8, 2, 1)
    stats = queue.stats()
    assert stats.counters == {"produced": 6, "trained": 4, "duplicate": 2}
    assert stats.pending == stats.backlog == 0
    accounting = queue.accounting()
    assert accounting.acked_other == {"duplicate": 2} and accounting.lost == 0


def test_entries_reclaimed_by_another_consumer_are_not_trained(make_learner, make_queue):
    groups = random_groups(4, vocab=VOCAB)
    learner, queue, _ = make_learner(groups[:1])  # one group short of a batch: the learner waits
    other = make_queue("learner-1", claim_idle_ms=50)

    def reclaim_then_produce():  # another consumer takes over an entry that looks abandoned
        deadline = time.monotonic() + 30
        while other.stats().pending < 1:  # the learner holds the group and waits for another
            assert time.monotonic() < deadline, "the learner never read the entry"
            time.sleep(0.01)
        stolen = []
        while not stolen:  # as soon as it has been idle > 50 ms
            assert time.monotonic() < deadline, "nothing to reclaim"
            stolen = [r.entry_id for r in other.get(1, block_ms=0)]
            time.sleep(0.01)
        other.put(groups[1:])
        return stolen[0]

    with ThreadPoolExecutor(1) as pool:
        stolen = pool.submit(reclaim_then_produce)
        metrics = learner.step()
        stolen = stolen.result()
    assert metrics.samples == 8 and metrics.counts["lost_to_reclaim"] == 1
    stats = queue.stats()
    assert stats.counters == {"produced": 4, "trained": 2, "reclaimed": 1}  # groups; no ack_lost
    assert stats.pending == 2 and stats.backlog == 0
    assert other.renew([stolen]) == [stolen]  # still the other consumer's, never acked
    held = queue.renew()
    assert len(held) == 1 and stolen not in held


def test_pi_prox_from_the_training_forward_gives_the_recomputed_update(make_learner):
    """One optimizer step per batch: pi_prox taken from the training forward (detached) instead
    of a separate pass changes nothing but the time. Behaviour log-probs differ from pi_prox, so
    the behaviour weights and their cap are in play."""
    groups = random_groups(2, vocab=VOCAB, seed=5)
    results = []
    for from_forward in (True, False):
        copy = [g.with_version(0, f"{g.group_id}/{from_forward}") for g in groups]  # no duplicate
        learner, _, publisher = make_learner(copy, is_cap=1.1)
        assert learner.prox_from_forward  # the default: minibatches=1, ratio_to=prox
        learner.prox_from_forward = from_forward
        be, passes = learner.backend, []
        logprobs = be.logprobs
        be.logprobs = lambda *a, **k: passes.append(1) or logprobs(*a, **k)
        metrics = learner.step()
        assert len(passes) == (2 if from_forward else 4)  # 2 micro-batches, + a recompute pass each
        results.append((metrics, publisher.weights))
    (fused, w_fused), (recomputed, w_recomputed) = results
    for key in ("loss", "bw_mean", "bw_max", "bw_capped_frac", "grad_norm"):
        assert getattr(fused, key) == pytest.approx(getattr(recomputed, key), rel=1e-5, abs=1e-7), key
    assert 0 < fused.bw_capped_frac < 1
    for name, w in w_fused.items():
        torch.testing.assert_close(w, w_recomputed[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_learner_s_models_run_without_dropout(tmp_path, family):
    """vLLM samples without dropout, so the learner's forwards must not add it, in training mode
    too: GPT-2's nn.Dropout modules (0.1 by default) and Llama's functional attention dropout."""
    from transformers import AutoModelForCausalLM

    from async_rlhf.synthetic import PRESETS, family_config

    config = family_config(family, PRESETS["tiny"], VOCAB)
    if family == "llama":
        config.attention_dropout = 0.1
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    models = load_models(LearnerConfig(kl_coef=0.1), str(tmp_path), "cpu", torch.float32)
    ids = torch.randint(3, VOCAB, (2, 12))
    for model in (models.policy.train(), models.reference.train()):
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("overrides", [
    dict(advantage="gae", kl_coef=0.1, kl_mode="reward", critic_lr=1e-3),
    dict(advantage="reinforce_pp", kl_coef=0.1, kl_estimator="k2", gamma=0.9, entropy_coef=0.01),
    dict(advantage="rloo", minibatches=2, loss_agg="seq_mean_token_sum", correction="mask",
         correction_level="sequence", ratio_to="behavior"),
])
def test_other_estimators_and_kl_modes_train(make_learner, overrides):
    learner, queue, _ = make_learner(random_groups(4, vocab=VOCAB), **overrides)
    history = learner.train(steps=2)
    assert learner.version == 2 and queue.stats().counters["trained"] == 4  # groups
    for m in history:
        assert all(math.isfinite(v) for v in m.to_json().values() if isinstance(v, float)), m
    if overrides["advantage"] == "gae":
        assert "value_loss" in history[-1].extra and history[-1].extra["kl"] > 0


def test_a_non_finite_loss_skips_the_step_and_the_next_batch_trains(make_learner, caplog):
    check_nonfinite_step_is_skipped(*make_learner(), caplog)


def test_resume_restores_weights_optimizer_version_and_counters(make_learner, tmp_path):
    """A checkpoint every step keeps the newest two; a new learner resumes from the newest with
    its version, counters and weights, and its next step equals the one the first learner took."""
    groups = random_groups(6, vocab=VOCAB, seed=9)
    cfg = dict(checkpoint_every=1, advantage="gae", critic_lr=1e-3)  # a critic to checkpoint too
    learner, queue, publisher = make_learner(groups[:4], **cfg)
    learner.ckpt_dir = tmp_path
    learner.train(steps=2)
    assert checkpoint_version(tmp_path) == 2 and sorted(p.name for p in tmp_path.glob("v*")) == ["v1", "v2"]
    saved, counters = learner.backend.full_state_dict(), dict(learner.counters)
    queue.put([g.with_version(2) for g in groups[4:]])
    learner.step()  # v3, a checkpoint too
    (tmp_path / "latest").write_text("v2")  # as if it had crashed before that checkpoint

    resumed, queue, publisher = make_learner(**cfg)
    resumed.ckpt_dir = tmp_path
    assert resumed.resume()
    assert resumed.version == 2 and resumed.counters == counters
    assert all(torch.equal(saved[k], v) for k, v in resumed.backend.full_state_dict().items())
    queue.put([g.with_version(2, f"{g.group_id}/again") for g in groups[4:]])  # no copy: new ids
    resumed.step()
    after, after_resumed = learner.backend.full_state_dict(), resumed.backend.full_state_dict()
    assert any(not torch.equal(saved[k], after[k]) for k in saved)
    for k in after:  # Adam's moments and step count came back too: they shape the update
        torch.testing.assert_close(after_resumed[k], after[k], rtol=0, atol=1e-6)


def test_acks_follow_checkpoints_and_a_crash_trains_the_unsaved_groups_again(make_learner, tmp_path):
    """checkpoint_every=2: a group counts as trained only once a checkpoint holds its update;
    until then it is pending and held (awaiting_checkpoint). A learner that dies after step 3
    resumes from v2, trains step 3's groups again, and the stream's `trained` then counts the
    groups the final weights were trained on: 4 steps x 2 groups."""
    groups = random_groups(8, vocab=VOCAB, seed=11)
    learner, queue, _ = make_learner(groups, checkpoint_every=2, max_staleness=4)
    learner.ckpt_dir = tmp_path

    def books():
        s = queue.stats()
        return s.counters.get("trained", 0), s.held, s.learner_version

    learner.step()
    assert books() == (0, 2, 1)  # trained, held until the checkpoint
    assert queue.accounting().awaiting_checkpoint == 2 and queue.accounting().lost == 0
    learner.step()  # v2, checkpointed: both steps' groups are trained for good
    assert books() == (4, 0, 2)
    learner.step()  # v3, then the learner dies before its checkpoint
    assert books() == (4, 2, 3)
    step3 = set(learner._unsaved)

    resumed, queue, _ = make_learner(checkpoint_every=2, max_staleness=4)
    resumed.ckpt_dir = tmp_path
    assert resumed.resume() and resumed.version == 2
    assert books() == (4, 0, 2)  # step 3's groups are to train again
    resumed.step()
    assert set(resumed._unsaved) == step3  # trained again first (pending under our name)
    resumed.step()  # v4: the last 2 groups, checkpointed
    assert books() == (8, 0, 4) and resumed.counters["trained_first_use"] == 8
    acc = queue.accounting()
    assert (acc.produced, acc.trained, acc.dead_lettered, acc.left_in_queue, acc.lost) == (8, 8, 0, 0, 0)


def test_a_crash_between_a_checkpoint_and_its_acks_trains_nothing_twice(make_learner, tmp_path):
    """The checkpoint lists the groups it holds (acks_due): a learner that dies after writing
    it but before acking them acks them when it resumes, and does not train them again."""
    learner, queue, _ = make_learner(random_groups(4, vocab=VOCAB, seed=12), checkpoint_every=2)
    learner.ckpt_dir = tmp_path
    learner.step()

    def die(*args, **kwargs):
        raise SystemExit("killed after the checkpoint, before its acks")

    learner.queue.ack = die  # the process dies in its next ack (the checkpoint's)
    with pytest.raises(SystemExit):
        learner.step()
    assert checkpoint_version(tmp_path) == 2 and queue.stats().held == 4
    resumed, queue, _ = make_learner(checkpoint_every=2)
    resumed.ckpt_dir = tmp_path
    assert resumed.resume()
    stats = queue.stats()
    assert (stats.counters["trained"], stats.held, stats.pending, stats.backlog) == (4, 0, 0, 0)


def test_the_lr_warms_up_decays_and_a_resumed_learner_takes_it_up_where_it_was_saved(make_learner, tmp_path):
    """learner.lr_warmup_steps=2, lr_schedule=linear over 4 steps at lr 1e-3: steps 0-3 train at
    5e-4, 1e-3 (warmup 1/2, 2/2), 1e-3, 5e-4 (1 - p, p = 0, 1/2). A learner resumed at version 2
    goes on at step 2's lr, not from the start of the warmup."""
    def step_lrs(learner, n):  # each step's lr metric, checked against the lr AdamW stepped with
        metrics = [learner.step() for _ in range(n)]
        assert metrics[-1].lr == learner.backend._optimizers["policy"].param_groups[0]["lr"]
        return [m.lr for m in metrics]

    groups = random_groups(8, vocab=VOCAB, seed=4)
    cfg = dict(lr=1e-3, steps=4, lr_warmup_steps=2, lr_schedule="linear", checkpoint_every=1)
    learner, _, _ = make_learner(groups[:4], **cfg)
    learner.ckpt_dir = tmp_path
    assert step_lrs(learner, 2) == pytest.approx([5e-4, 1e-3])

    resumed, queue, _ = make_learner(**cfg)
    resumed.ckpt_dir = tmp_path
    assert resumed.resume() and resumed.version == 2
    queue.put([g.with_version(2) for g in groups[4:]])
    assert step_lrs(resumed, 2) == pytest.approx([1e-3, 5e-4])


def test_keep_checkpoints_keeps_that_many_newest(make_learner, tmp_path):
    learner, _, _ = make_learner(random_groups(8, vocab=VOCAB, seed=6), max_staleness=4,
                                 checkpoint_every=1, keep_checkpoints=3)
    learner.ckpt_dir = tmp_path
    learner.train(steps=4)
    assert checkpoint_version(tmp_path) == 4
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v2", "v3", "v4"]


def test_token_staleness_counts_each_token_by_the_version_that_sampled_it():
    crossed = make_group(size=2, policy_version=3, version_spans=((3, 0), (5, 2)))  # 3, 3, 5, 5
    assert token_staleness([Received("1-0", crossed)], 5) == 1.0  # by sample it is 2
    assert token_staleness([Received("2-0", make_group(size=1, policy_version=4))], 5) == 1.0
    assert math.isnan(token_staleness([], 5))  # ranks without items
