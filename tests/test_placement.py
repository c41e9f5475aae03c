"""placement: auto: the rule that sizes the stages (pure arithmetic, worked out by hand)."""

from __future__ import annotations

import dataclasses

import pytest

from async_rlhf.config import ConfigError, load_config
from async_rlhf.launch.placement import apply_placement, choose_placement


def test_shared_cores_learner_everywhere_generators_their_share():
    # the small preset on 2 cores: generation 1.3 s, training 5.4 s per 64 samples on one core
    p = choose_placement(2, 0.02, 0.084, shared=True)
    assert (p.gen_devices, p.learner_devices) == (1, 2)
    assert p.samples_per_s == pytest.approx(2 / 0.104)  # both stages' work packed on 2 cores
    assert "generators on 1 core(s), the learner on all 2" in p.why


def test_shared_cores_generation_heavy_gets_more_engines_but_rate_stays_packed():
    p = choose_placement(2, 0.06, 0.02, shared=True)  # 75% of the work: ceil(1.5) = 2 engines
    assert (p.gen_devices, p.learner_devices) == (2, 2)
    assert p.samples_per_s == pytest.approx(2 / 0.08)
    p = choose_placement(8, 0.05, 0.05, shared=True)  # half the work: 4 of 8 cores
    assert (p.gen_devices, p.learner_devices) == (4, 8)


def test_shared_cores_generator_share_caps_the_rate():
    # one core: the generator's share rounds up to the whole core; the packed bound 1/(g+l)
    p = choose_placement(1, 0.01, 0.03, shared=True)
    assert (p.gen_devices, p.learner_devices) == (1, 1) and p.samples_per_s == pytest.approx(25.0)


def test_gpus_split_to_balance_the_stages():
    # generation 3x the learner's cost: 6 generator GPUs, 2 learner GPUs, each stage 2 samples/s
    p = choose_placement(8, 3.0, 1.0, shared=False)
    assert (p.gen_devices, p.learner_devices) == (6, 2) and p.samples_per_s == pytest.approx(2.0)
    # engines of 4 GPUs: 4 (rate min(4/3, 4)) beats nothing else; 8 would leave the learner none
    p = choose_placement(8, 3.0, 1.0, shared=False, gen_unit=4)
    assert (p.gen_devices, p.learner_devices) == (4, 4) and p.samples_per_s == pytest.approx(4 / 3)


def test_gpus_tie_goes_to_the_learner():
    # 1 gen GPU: min(1, 3/2) = 1; 2 gen GPUs: min(2, 2/2) = 1: equal, the learner keeps 3
    assert choose_placement(4, 1.0, 2.0, shared=False).learner_devices == 3


def test_bad_costs_and_too_few_devices_say_the_fix():
    with pytest.raises(ValueError, match="stage_costs.generator_s"):
        choose_placement(2, 0.0, 0.1, shared=True)
    with pytest.raises(ValueError, match="at least 2 device"):
        choose_placement(1, 1.0, 1.0, shared=False)
    with pytest.raises(ValueError, match="at least 4 device"):
        choose_placement(3, 1.0, 1.0, shared=False, gen_unit=3)


def test_apply_placement_sets_counts_ranks_and_threads(tmp_path):
    cfg = load_config(None, ["learner.batch_size=64", "learner.micro_batch=16"])  # auto: the default
    placed, line = apply_placement(cfg, devices=2, gpu=False)
    assert (placed.generator.count, placed.generator.threads, placed.generator.nice) == (1, 1, 19)
    assert (placed.learner.ranks, placed.learner.threads) == (2, 1)
    assert line.startswith("placement auto: 1 generator(s) x 1 thread(s) at nice 19, learner 2 rank(s) x 1 thread(s)")
    (tmp_path / "config.yaml").write_text(placed.to_yaml())  # saved as OUT/config.yaml, it reruns as it ran
    assert load_config(tmp_path / "config.yaml") == placed
    # 3 cores, 4 micro-batches: 2 ranks (the largest divisor that fits), 1 thread each
    placed, _ = apply_placement(cfg, devices=3, gpu=False)
    assert (placed.learner.ranks, placed.learner.threads) == (2, 1)
    # one micro-batch per step: one rank, the cores as its threads
    single = load_config(None, ["placement=auto", "learner.batch_size=16", "learner.micro_batch=16"])
    placed, _ = apply_placement(single, devices=4, gpu=False)
    assert (placed.learner.ranks, placed.learner.threads) == (1, 4)
    # the torch backend is one process: the cores become its threads
    placed, _ = apply_placement(dataclasses.replace(cfg, learner=dataclasses.replace(
        cfg.learner, backend="torch")), devices=2, gpu=False)
    assert (placed.learner.ranks, placed.learner.threads) == (1, 2)


def test_apply_placement_gpu_and_manual():
    cfg = load_config(None, ["placement=auto", "stage_costs.generator_s=3", "stage_costs.learner_s=1",
                             "learner.batch_size=64", "learner.micro_batch=16"])
    placed, _ = apply_placement(cfg, devices=8, gpu=True)
    assert (placed.generator.count, placed.learner.ranks, placed.learner.threads) == (6, 2, 1)
    assert placed.generator.nice == 0  # GPUs are not time-shared: no priority to give
    with pytest.raises(ValueError, match="learner.batch_size a multiple of learner.micro_batch x 3"):
        apply_placement(cfg, devices=12, gpu=True)  # 9 + 3: 4 micro-batches do not split over 3
    torch = load_config(None, ["placement=auto", "stage_costs.generator_s=3", "stage_costs.learner_s=1",
                               "learner.backend=torch"])
    with pytest.raises(ValueError, match="learner.backend=torch trains on one: set learner.backend=deepspeed"):
        apply_placement(torch, devices=8, gpu=True)
    manual = load_config(None, ["placement=manual", "generator.count=3"])
    assert apply_placement(manual, devices=2, gpu=False) == (manual, "")


def test_apply_placement_gives_the_evaluator_its_own_gpus_and_none_on_cpu():
    base = ["placement=auto", "stage_costs.generator_s=3", "stage_costs.learner_s=1", "learner.batch_size=64",
            "learner.micro_batch=16", "eval.every=5", "generator.tensor_parallel=2"]
    placed, line = apply_placement(load_config(None, base), devices=10, gpu=True)
    # 2 GPUs for the evaluator's engine, 8 split: 3 engines of 2 for generation, 2 learner ranks
    assert (placed.generator.count, placed.learner.ranks) == (3, 2) and "evaluator 2 GPU(s)" in line
    placed, line = apply_placement(load_config(None, base[:-1]), devices=4, gpu=False)
    assert placed.learner.ranks * placed.learner.threads == 4 and "evaluator" not in line


def test_config_checks_placement_keys():
    with pytest.raises(ConfigError, match="placement must be one of 'manual', 'auto', got 'fast'"):
        load_config(None, ["placement=fast"])
    with pytest.raises(ConfigError, match=r"generator.nice must be from 0 \(normal priority\) to 19 \(lowest\), got 20"):
        load_config(None, ["generator.nice=20"])
    with pytest.raises(ConfigError, match="stage_costs.learner_s must be > 0, got 0"):
        load_config(None, ["stage_costs.learner_s=0"])
    with pytest.raises(ConfigError, match="learner.ranks must be 1 with learner.backend=torch"):
        load_config(None, ["placement=manual", "learner.backend=torch", "learner.ranks=2", "learner.batch_size=16"])
    # what placement: auto sizes is not also given by hand
    with pytest.raises(ConfigError, match=r"generator.count must be left out with placement: auto, which sizes "
                                          r"it \(or set placement: manual\), got 2"):
        load_config(None, ["generator.count=2"])
