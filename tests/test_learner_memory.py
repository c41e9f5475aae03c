"""What keeps the learner within memory at real sizes: log-probs and entropy from a chunked LM
head (no [B, T, vocab] logits), gradient checkpointing, optimizer offload, the reference's
precision; each computes what the plain path computes."""

import pytest
import torch

from async_rlhf.synthetic import FAMILIES, build_model
from learners import models
from learners.models import response_logprobs


def _full_logits_path(model, input_ids, attention_mask, positions, temperature):
    """log pi and entropy from the model's whole [B, L, vocab] logits (the plain way)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    logits = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
    logp = torch.log_softmax(logits, -1).gather(-1, input_ids.gather(1, positions + 1)[..., None])[..., 0]
    probs = torch.softmax(logits, -1)
    return logp, torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_head_log_probs_entropy_and_grads_equal_the_whole_logits(family, monkeypatch):
    vocab = 300
    monkeypatch.setattr(models, "LOGIT_CHUNK_ELEMENTS", 7 * vocab)  # 7 tokens a chunk: several chunks
    model = models.disable_dropout(build_model("tiny", vocab_size=vocab, family=family).train())
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (3, 20), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, :4] = 0  # a left-padded row
    positions = torch.arange(9, 19).expand(3, -1).contiguous()  # 10 response tokens a row

    grads = []
    for path in (_full_logits_path, None):
        model.zero_grad()
        if path is None:
            logp, entropy = response_logprobs(model, input_ids, attention_mask, positions, 0.7,
                                              with_entropy=True, entropy_grad=True)
        else:
            logp, entropy = path(model, input_ids, attention_mask, positions, 0.7)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        grads.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                      logp.detach(), entropy.detach()))
    (want, want_logp, want_ent), (got, got_logp, got_ent) = grads
    torch.testing.assert_close(got_logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=1e-5)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend, zero_stage, settings", [
    ("torch", 0, {"gradient_checkpointing": True}),
    ("deepspeed", 1, {"gradient_checkpointing": True}),
    ("deepspeed", 1, {"offload_optimizer": True}),
    ("deepspeed", 3, {"offload_optimizer": True, "offload_params": True}),
], ids=["checkpointing-torch", "checkpointing-zero1", "offload-optimizer-zero1", "offload-all-zero3"])
def test_memory_settings_train_to_the_same_loss_and_weights(make_learner, backend, zero_stage, settings):
    """Three steps on the same groups, with and without the setting: the same losses, and weights
    within 1e-4 (fp32: recomputation, another attention kernel and the host step change only
    rounding, which AdamW's normalised steps can lift to ~1e-4 on a parameter of near-zero
    gradient; each step moves a weight by up to lr = 3e-3)."""
    from async_rlhf.synthetic import random_groups
    from helpers import VOCAB

    runs, groups = [], random_groups(6, vocab=VOCAB, seed=5)
    for run, extra in enumerate(({}, settings)):  # one stream: the second run's groups get new ids
        fresh = [g.with_version(0, f"{g.group_id}-{run}") for g in groups]
        learner, queue, publisher = make_learner(fresh, backend=backend,
                                                 zero_stage=zero_stage, mixed_precision="fp32", **extra)
        losses = [learner.step().loss for _ in range(3)]
        runs.append((losses, publisher.weights))
    (want_losses, want_w), (got_losses, got_w) = runs
    assert got_losses == pytest.approx(want_losses, rel=1e-4, abs=1e-6)
    assert want_losses[-1] != want_losses[0]  # it trained
    for name in want_w:
        torch.testing.assert_close(got_w[name], want_w[name], atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_a_weight_update_streams_the_live_weights_with_no_whole_copy(make_learner, backend):
    """The publisher is handed each policy weight where it lives, one at a time (it copies each
    into its bucket): no whole copy of the model exists beside the buckets (a 0.5B model's
    would be 2 GB on the learner at every step)."""
    learner, _, _ = make_learner(backend=backend)
    params = dict(learner.backend.run_policy.named_parameters()) if backend == "torch" else \
        dict(learner.backend.engine.module.named_parameters())
    seen = []

    class Publisher:
        def publish(self, named_tensors, version):
            for name, t in named_tensors:
                assert t.untyped_storage().data_ptr() == params[name].untyped_storage().data_ptr(), name
                seen.append(name)

    learner.publisher = Publisher()
    learner.publish_weights()
    assert seen == list(params)
