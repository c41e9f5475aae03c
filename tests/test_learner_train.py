"""The DeepSpeed backend under the learner, in this process (one rank, gloo on CPU), fed by the
real Redis experience stream (a fresh stream per test) and the real staleness replay buffer: bf16,
ZeRO stages, the critic, HF export and skipped steps. The loop itself is tested on the torch
backend in test_learner_loop.py; several ranks in test_learner_dist.py."""

import functools
import math

import pytest
import torch
from helpers import VOCAB, check_nonfinite_step_is_skipped

from async_rlhf.synthetic import random_groups


@pytest.fixture
def make_learner(make_learner):
    """conftest's make_learner on the DeepSpeed backend."""
    return functools.partial(make_learner, backend="deepspeed")


def test_bf16_zero2_trains(make_learner):
    learner, queue, publisher = make_learner(random_groups(2, vocab=VOCAB),
                                             dtype="bfloat16", zero_stage=2)
    metrics = learner.step()
    assert math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)
    assert publisher.weights["lm_head.weight"].dtype == torch.bfloat16


def test_critic_starts_from_the_reward_model(tiny_learner_model, make_learner, tmp_path):
    from transformers import AutoConfig, LlamaForSequenceClassification

    torch.manual_seed(5)
    reward_model = LlamaForSequenceClassification(AutoConfig.from_pretrained(tiny_learner_model, num_labels=1))
    reward_model.save_pretrained(tmp_path / "rm")
    learner, _, _ = make_learner(random_groups(2, vocab=VOCAB), advantage="gae",
                                 critic_init=str(tmp_path / "rm"))
    critic = learner.backend.critic.module
    assert torch.equal(critic.head.weight, reward_model.score.weight)
    assert torch.equal(critic.backbone.embed_tokens.weight, reward_model.model.embed_tokens.weight)
    assert math.isfinite(learner.step().extra["value_loss"])


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_hf_export_round_trips(make_learner, tmp_path, zero_stage):
    from transformers import AutoModelForCausalLM

    learner, _, _ = make_learner(random_groups(2, vocab=VOCAB), zero_stage=zero_stage)
    learner.step()
    learner.backend.save_pretrained(tmp_path / "hf")
    weights = learner.backend.full_state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for name, p in reloaded.named_parameters():
        assert torch.equal(p, weights[name]), name


@pytest.mark.parametrize("zero_stage, dtype", [(0, "float32"), (2, "float32"), (3, "float32"),
                                               (0, "bfloat16")])
def test_a_non_finite_loss_skips_the_step_and_the_next_batch_trains(make_learner, caplog, zero_stage,
                                                                    dtype):
    """ZeRO-0 fp32 skips in our backend, ZeRO 1-3 and bf16 in DeepSpeed's overflow path."""
    check_nonfinite_step_is_skipped(*make_learner(zero_stage=zero_stage, dtype=dtype), caplog)


def test_the_lr_schedule_reaches_the_optimizer_inside_deepspeeds_zero_wrapper(make_learner):
    """ZeRO-2 wraps our AdamW; the lr the learner sets each step is the one AdamW steps with
    (warmup 1/2 of lr 1e-3, then 1e-3)."""
    learner, _, _ = make_learner(random_groups(4, vocab=VOCAB), zero_stage=2, lr=1e-3, lr_warmup_steps=2)
    adamw = learner.backend.engine.optimizer.optimizer
    assert isinstance(adamw, torch.optim.AdamW)
    for want in (5e-4, 1e-3):
        assert learner.step().lr == want and adamw.param_groups[0]["lr"] == want
