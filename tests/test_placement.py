"""placement: auto: the rule that sizes the stages (pure arithmetic, worked out by hand)."""

from __future__ import annotations

import dataclasses

import pytest

from async_rlhf.config import ConfigError, load_config
from async_rlhf.launch.placement import _candidates, apply_placement, choose_placement, part_resources


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


def test_one_gpu_is_colocated_and_its_parts_share_it_in_ray():
    """auto on one GPU: a generator engine and a learner rank (and the evaluator) each ask Ray for a
    share of it, and Ray places them all on a node of one GPU, where whole GPUs would not fit;
    vLLM gets 30% of its memory. Counts that cannot share one GPU are refused, naming the key."""
    import ray

    from async_rlhf.launch import groups

    placed, line = apply_placement(load_config(None, ["eval.every=5"]), devices=1, gpu=True)
    assert placed.placement == "colocated" and (placed.generator.count, placed.learner.ranks) == (1, 1)
    assert placed.generator.gpu_memory_utilization == 0.3
    assert line == ("placement colocated: 1 generator(s) and the learner's 1 rank(s) share 0.33 of the GPU each, "
                    "vLLM 30% of its memory; weights pass through shared memory (CUDA IPC)")
    whole = part_resources(load_config(None, ["placement=manual", "eval.every=5"]), gpu=True)
    shares = part_resources(placed, gpu=True)
    assert shares == {"learner": {"CPU": 1.0, "GPU": 1 / 3}, "generator": {"CPU": 1.0, "GPU": 1 / 3},
                      "evaluator": {"CPU": 1.0, "GPU": 1 / 3}}
    assert part_resources(placed, gpu=False)["generator"] == {"CPU": 1.0}
    ray.init(num_cpus=3, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        reserved = [groups.reserve(ray, [need], "STRICT_PACK", name) for name, need in shares.items()]
        assert all(g.wait(60) for g in reserved)
        for g in reserved:
            groups.release(g)
        first, second = (groups.reserve(ray, [whole[name]], "STRICT_PACK", name) for name in ("learner", "generator"))
        assert first.wait(60) and not second.wait(2)
    finally:
        ray.shutdown()

    with pytest.raises(ValueError, match="at least 2 device"):  # joining a cluster: never colocated
        apply_placement(load_config(None), devices=1, gpu=True, one_node=False)
    with pytest.raises(ConfigError, match=r"generator.tensor_parallel=2: placement: colocated shares one GPU"):
        apply_placement(load_config(None, ["generator.tensor_parallel=2"]), devices=1, gpu=True)
    cpu = load_config(None, ["placement=colocated", "generator.count=2", "learner.threads=2"])
    placed, line = apply_placement(cpu, devices=2, gpu=False)  # cores are time-shared: counts as given
    assert placed == cpu and line.startswith("placement colocated: 2 generator(s) and the learner's 1 rank(s) "
                                             "share the node's cores")


def test_a_colocated_job_does_not_join_a_cluster(tmp_path, tiny_actor_model):
    """Its weights pass through this node's shared memory: refused before anything starts."""
    from async_rlhf.launch.launcher import Job

    cfg = load_config(None, ["placement=colocated", f"model.path={tiny_actor_model}", f"out={tmp_path / 'job'}"])
    with pytest.raises(ConfigError, match=r"cannot join a Ray cluster \(--ray-address\): set placement: auto or manual"):
        Job(cfg, ray_address="10.0.0.1:6379").run()
    assert not (tmp_path / "job").exists()


def test_config_checks_placement_keys():
    with pytest.raises(ConfigError, match="placement must be one of 'manual', 'auto', 'colocated', got 'fast'"):
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


# Qwen2.5-0.5B's and Qwen2.5-7B's config.json (the shape the estimate reads)
QWEN_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "tie_word_embeddings": True, "max_position_embeddings": 32768}
QWEN_7B = {**QWEN_05B, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def test_the_shape_counts_parameters_as_the_models_do():
    from async_rlhf.launch.memory import ModelShape

    assert ModelShape.from_config(QWEN_05B).params == pytest.approx(494.03e6, rel=0.002)  # Qwen2.5-0.5B
    assert ModelShape.from_config(QWEN_7B).params == pytest.approx(7.616e9, rel=0.002)  # Qwen2.5-7B


def test_memory_auto_picks_the_fastest_setting_that_fits_and_prints_its_estimate():
    from async_rlhf.launch.memory import GB, ModelShape, Sizes, estimate

    cfg = load_config("configs/demo.yaml")
    sizes = Sizes(ModelShape.from_config(QWEN_05B), native_bf16=True, prompt_chars=30)
    plenty, line = apply_placement(cfg, 2, False, memory=64 * GB, sizes=sizes)
    assert (plenty.learner.ranks, plenty.learner.zero_stage, plenty.learner.gradient_checkpointing) == (2, 0, False)
    assert "memory: " in line and "of 64.0 GiB available" in line and "to fit" not in line
    assert "(255.9 vs learner 537.5 ms per sample on one core)" in line  # the small preset's costs x 12.8
    fitted, line = apply_placement(cfg, 2, False, memory=22 * GB, sizes=sizes)
    assert estimate(fitted, sizes).total <= 0.85 * 22 * GB < estimate(plenty, sizes).total
    assert "to fit: learner." in line
    # sharding comes before recomputation, recomputation before giving up a rank
    ranked = [(c.learner.ranks, c.learner.gradient_checkpointing, c.learner.zero_stage)
              for c in _candidates(plenty)]
    assert ranked == [(2, False, 0), (2, False, 1), (2, False, 2), (2, False, 3),
                      (2, True, 0), (2, True, 1), (2, True, 2), (2, True, 3), (1, False, 0), (1, True, 0)]
    with pytest.raises(ConfigError, match=r"placement: auto finds no setting that fits a 0.49B-parameter model "
                                          r"here: the smallest needs an estimated [\d.]+ GiB = learner 1 x"):
        apply_placement(cfg, 2, False, memory=8 * GB, sizes=sizes)


def test_memory_a_manual_setting_that_cannot_fit_is_refused_with_one_that_would():
    from async_rlhf.launch.memory import GB, ModelShape, Sizes

    cfg = load_config("configs/demo.yaml", ["placement=manual", "learner.ranks=2"])
    sizes = Sizes(ModelShape.from_config(QWEN_05B), native_bf16=True, prompt_chars=30)
    with pytest.raises(ConfigError) as e:
        apply_placement(cfg, 2, False, memory=22 * GB, sizes=sizes)
    assert "this job on a 0.49B-parameter model needs an estimated" in str(e.value)
    assert "this machine has 22.0 GiB available" in str(e.value)
    assert "set learner." in str(e.value) and "or placement=auto to choose" in str(e.value)
    same, line = apply_placement(cfg, 2, False, memory=64 * GB, sizes=sizes)
    assert same == cfg and line == ""  # it fits: manual stays as written


# What ended a 0.5B job on this 24 GiB machine (summary.json's error, Ray 2.x, trimmed)
RAY_OOM = """OutOfMemoryError: 1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 127.0.0.1, ID: 05d59f139ea878a3234df2b72c2494c41bc78aa67ee082e4fdc1a2b8) was 22.68GB used / 23.54GB limit (0.963487)
OOM kill reason: Memory usage 24239489024B exceeded threshold of 24012384256B (95.0% of 25276194816B limit)
Ray killed 1 worker(s) based on the killing policy
Considered workers: [
Selected to kill: (Actor(aed550b2f2b712b19c9cdaf501000000): job ID=01000000, lease ID=020000004009caf7e2cf3a08f53184292fe7d15d1256fb49f42bebc2b88950d6, task name=LearnerWorker.__init__, required resources={bundle_group_c9a46048237c7354ad9d0a23a3c501000000: 0.001, bundle_group_0_c9a46048237c7354ad9d0a23a3c501000000: 0.001, CPU_group_c9a46048237c7354ad9d0a23a3c501000000: 2, CPU_group_0_c9a46048237c7354ad9d0a23a3c501000000: 2}, pid=31652, actual memory used=15.04GB, worker ID=86fec9eefed4433ade78c1f8dcef6ecad632bb495e97b52dc0a0fc03)
(Actor(dd78f726e2c0d628765d0b7201000000): job ID=01000000, lease ID=0100000071c660823cb5a138ece101fd5ecd1d6e6c97cb1ca712336d62dd50fb, task name=gen-0:GeneratorWorker.__init__, required resources={bundle_group_d06bf2c99c63897610d836e7ef6301000000: 0.001, CPU_group_d06bf2c99c63897610d836e7ef6301000000: 1, CPU_group_0_d06bf2c99c63897610d836e7ef6301000000: 1, bundle_group_0_d06bf2c99c63897610d836e7ef6301000000: 0.001}, pid=31555, actual memory used=4.86GB, worker ID=b62cf47dfe96718db4ebe1f183f2ada2657c35d98fedeb2bc882f8ad)
(Actor(7bc15570ea833e07ee74565301000000): job ID=01000000, lease ID=000000008d519365664f4559f73a6dc0e0b6f2bd8ca4c2a988b0fef6c5005d04, task name=coordinator:Coordinator.__init__, required resources={}, pid=31556, actual memory used=0.06GB, worker ID=e2419d498d58b62a92489de931df35cbc0817bd5f65ad93a2d32f9f5)
]
Total non-selected idle workers: 0
Total non-selected idle workers USS bytes: 0.00GB
To see more information about memory usage on this node, use `ray logs raylet.out -ip 127.0.0.1`
Top 10 memory users: PID\tMEM(GB)\tCOMMAND
31652\t15.04\tray::LearnerWorker.step
31555\t4.86\tray::GeneratorWorker
31278\t1.62\t/work/main/.venv/bin/python -m async_rlhf.launch.cli bench-memory --shapes qwen2.5-0.5b --models /tm..."""


def test_an_out_of_memory_end_names_the_parts_their_estimates_and_a_setting_that_fits():
    from async_rlhf.launch.memory import ModelShape, Sizes, out_of_memory

    cfg = load_config("configs/demo.yaml", ["placement=manual", "learner.ranks=2"])
    sizes = Sizes(ModelShape.from_config(QWEN_05B), native_bf16=True, prompt_chars=30)
    text = out_of_memory(RAY_OOM, cfg, sizes)
    assert text.startswith("out of memory: Ray's memory monitor killed LearnerWorker.__init__ (15.04 GB) "
                           "with the node at 22.68 of 23.54 GB; the largest processes: learner rank 15.04 GB "
                           "(estimated "), text
    assert "generator 4.86 GB (estimated " in text
    assert ("Set learner.ranks=1, learner.threads=2, learner.gradient_checkpointing=true (estimated to fit, "
            "after scaling the estimate by what was measured here: learner 1.02x, generator 0.83x)") in text
    assert out_of_memory("RayActorError: the actor died unexpectedly", cfg, sizes) is None
