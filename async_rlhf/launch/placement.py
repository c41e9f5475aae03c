"""`placement: auto`: the learner's and the generators' share of the machine, from the stage costs.

The rule, in device-seconds per sample (a device is a GPU, or a CPU core running one thread):
generation costs c_gen on one device (at a full engine), training c_learn on one device. With
n_gen generator devices and n_learn learner devices the job trains at most
min(n_gen / c_gen, n_learn / c_learn) samples/s: the slower stage sets the rate, and the other
idles for the rest.

- Devices that cannot be shared (GPUs): split them, n_gen + n_learn = N, at the split that
  maximises that rate (n_gen near N * c_gen / (c_gen + c_learn); whole engines of
  generator.tensor_parallel devices; ties go to the learner). This is the decision AReaL's
  allocation mode (`sglang.d6+fsdp.d2`) and verl's resource pools leave to the user: here it
  comes from the costs.
- Devices that can be shared (CPU cores, which the OS time-shares between processes): the same
  split would leave the idle stage's cores idle (on 2 cores, with the learner 4x the cost of
  generation, the generator's core idles ~3/4 of the time). So the generators keep their share
  (rounded up, at least one engine), and the learner gets every core as data-parallel ranks of
  one thread each (ranks scale on CPU; a rank's extra threads gain little on small matrices:
  bench-learner): the learner runs wherever the generators leave a core idle, and a generator that
  waits on the staleness gate sleeps, yielding its core. The generators run at the lowest CPU
  priority (generator.nice=19 once their engine is up; the learner ranks run at nice 15, Ray's
  workers' default: async_rlhf.procs), so that where both want a core the learner gets about 70%
  of it (the kernel's weights for nice 15 and 19);
  measured on configs/bench.yaml at k = 2, side by side: 13.5-14.0 samples/s against 12.2-12.7 at
  the same nice, and 11.8-12.1 with the learner at nice 0, which starved generation. Throughput is then bounded by
  N / (c_gen + c_learn), the perfect packing of both stages' work on the machine.
  The ranks are the largest divisor of the batch's micro-batches that fits the cores; the cores
  left over go to each rank as threads.

Costs come from the config (`stage_costs`: defaults measured on the small preset) or
from measurement (`async-rlhf bench` passes its stage bounds to its auto settings).

One GPU cannot be split between the stages: there auto picks `placement: colocated` (colocate),
in which one generator engine and one learner rank share the device, as TRL's colocated vLLM
and verl's and OpenRLHF's hybrid engines do; unlike theirs, generation goes on while the learner
steps (the staleness bound as everywhere), so the engine keeps its memory, bounded by
generator.gpu_memory_utilization, instead of sleeping through each step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from async_rlhf.config import Config, ConfigError, StageCosts
from async_rlhf.launch.memory import GB, MemoryEstimate, Sizes, estimate

# The share of the node's available memory a job may plan to use: the rest covers the estimate's
# error (within 25% in bench-memory) before Ray's memory monitor (95% of the node) kills a part
MEMORY_SHARE = 0.85


@dataclass(frozen=True)
class Placement:
    gen_devices: int  # devices (CPU: cores, one thread each) the generators use
    learner_devices: int  # devices the learner's ranks use
    samples_per_s: float  # the rule's prediction: the bound it sizes for
    why: str


def choose_placement(devices: int, gen_s: float, learn_s: float, *, shared: bool,
                     gen_unit: int = 1) -> Placement:
    """Generator and learner devices for `devices` devices, given each stage's device-seconds
    per sample on one device (`gen_s`, `learn_s`); `shared`: the OS time-shares them (CPU
    cores); `gen_unit`: devices per generator engine (tensor parallel). See the module doc."""
    if gen_s <= 0 or learn_s <= 0:
        raise ValueError(f"stage costs must be > 0 seconds per sample, got generator {gen_s!r} and "
                         f"learner {learn_s!r}: set stage_costs.generator_s and stage_costs.learner_s")
    if devices < gen_unit + (0 if shared else 1):
        raise ValueError(f"placement: auto needs at least {gen_unit + (0 if shared else 1)} device(s) "
                         f"(a generator of {gen_unit} and, unless shared, one for the learner), "
                         f"got {devices}")
    gen_share = gen_s / (gen_s + learn_s)
    if shared:
        n_gen = min(devices, gen_unit * max(1, math.ceil(devices * gen_share / gen_unit)))
        rate = min(devices / (gen_s + learn_s), n_gen / gen_s)
        why = (f"{devices} shared cores; generation costs {gen_share:.0%} of the work "
               f"({gen_s * 1000:.1f} vs learner {learn_s * 1000:.1f} ms per sample on one core): "
               f"generators on {n_gen} core(s), the learner on all {devices} (it runs where they idle); "
               f"bound {rate:.1f} samples/s (both stages packed on the machine)")
        return Placement(n_gen, devices, rate, why)
    splits = range(gen_unit, devices, gen_unit)
    n_gen = max(splits, key=lambda g: (min(g / gen_s, (devices - g) / learn_s), -g))
    rate = min(n_gen / gen_s, (devices - n_gen) / learn_s)
    why = (f"{devices} devices; generation costs {gen_share:.0%} of the work ({gen_s * 1000:.1f} vs "
           f"learner {learn_s * 1000:.1f} ms per sample on one device): {n_gen} for generators, "
           f"{devices - n_gen} for the learner; bound {rate:.1f} samples/s")
    return Placement(n_gen, devices - n_gen, rate, why)


# vLLM's share of the GPU's memory where it shares the device with the learner
# (generator.gpu_memory_utilization auto): the learner's weights, gradients, optimizer state
# and activations take the rest
COLOCATED_ENGINE_MEMORY = 0.3


def gpu_share(cfg: Config) -> float:
    """The fraction of a GPU each part asks Ray for: colocated, the learner rank, the generator
    and the evaluator (if any) share one, a like share each; else whole GPUs."""
    return 1.0 / (2 + bool(cfg.eval.every)) if cfg.placement == "colocated" else 1.0


def part_resources(cfg: Config, gpu: bool) -> dict[str, dict[str, float]]:
    """The Ray resources of a learner rank, a generator (before its generator.resources) and the
    evaluator: CPUs for their threads, and on GPU their engine's or rank's GPUs, whole or
    (colocated) a share of one."""
    share = gpu_share(cfg) if gpu else 0.0
    engine = cfg.generator.tensor_parallel * share

    def need(cpus: int, gpus: float) -> dict[str, float]:
        return {"CPU": float(cpus), **({"GPU": gpus} if gpus else {})}

    return {"learner": need(cfg.learner.threads, share), "generator": need(cfg.generator.threads, engine),
            "evaluator": need(1, engine)}


def colocate(cfg: Config, gpus: int) -> tuple[Config, str]:
    """A colocated job (module doc) on `gpus` GPUs (0: CPU cores, which are time-shared anyway:
    the counts stay the config's) and the line that says so; raises ConfigError where the counts
    do not fit one GPU, naming them."""
    g, lc = cfg.generator, cfg.learner
    if gpus:
        for key, value in (("generator.count", g.count), ("generator.tensor_parallel", g.tensor_parallel),
                           ("learner.ranks", lc.ranks)):
            if value != 1:
                raise ConfigError(f"{key}={value}: placement: colocated shares one GPU between one generator "
                                  f"engine and one learner rank, so it must be 1 (for more GPUs set "
                                  f"placement: auto or manual)")
        if g.gpu_memory_utilization == "auto":
            cfg = dataclasses.replace(cfg, generator=dataclasses.replace(g, gpu_memory_utilization=COLOCATED_ENGINE_MEMORY))
    share = gpu_share(cfg)
    devices = f"{share:.2f} of the GPU each" if gpus else "the node's cores"
    return cfg, (f"placement colocated: {cfg.generator.count} generator(s) and the learner's {lc.ranks} rank(s) "
                 f"share {devices}{'' if not gpus else f', vLLM {cfg.generator.gpu_memory_utilization:.0%} of its memory'}; "
                 "weights pass through shared memory" + (" (CUDA IPC)" if gpus else ""))


def apply_placement(cfg: Config, devices: int, gpu: bool, memory: float | None = None,
                    sizes: Sizes | None = None, one_node: bool = True) -> tuple[Config, str]:
    """`cfg` with generator.count/threads and learner.ranks/threads set by the rule (unchanged
    unless cfg.placement is auto), and a line saying what was chosen and why. The config returned
    says placement: manual, with those counts: saved (OUT/config.yaml), it reruns as it ran.
    On one GPU auto chooses placement: colocated (colocate), which a config may also ask for;
    not where the job joins a cluster (`one_node` False), whose parts a colocated job cannot span.

    With `memory` (the bytes this node can give the job; None: not checked, e.g. on a cluster
    whose parts run elsewhere) and `sizes` (the model's shape...), the job must fit
    (launch/memory.py): auto takes the fastest of the settings that fit (fit_memory); a manual
    config that does not fit raises ConfigError with the estimate and the settings that would.
    On GPUs the devices' memory is not checked yet."""
    auto = cfg.placement == "auto"
    if auto and gpu and devices == 1 and one_node:
        cfg = dataclasses.replace(cfg, placement="colocated", learner=dataclasses.replace(cfg.learner, threads=1),
                                  generator=dataclasses.replace(cfg.generator, threads=1))
    if cfg.placement == "colocated":
        cfg, chosen = colocate(cfg, devices if gpu else 0)
    elif auto:
        cfg, chosen = _by_costs(_scaled_costs(cfg, sizes), devices, gpu)
    else:
        chosen = ""
    if memory is None or sizes is None or gpu:
        return cfg, chosen
    fitted, est = fit_memory(cfg, memory, sizes, auto=auto)
    if fitted is None:
        raise ConfigError(_no_fit(cfg, est, memory, sizes, auto=auto))
    changed = _changes(cfg, fitted)
    if chosen:
        chosen += f"\nmemory: {est.line()} of {memory / GB:.1f} GiB available"
        if changed:
            chosen += f" (to fit: {changed})"
    return fitted, chosen


# The parameters of the preset the default stage costs were measured on (small)
COSTS_MEASURED_ON = 38.6e6


def _scaled_costs(cfg: Config, sizes: Sizes | None) -> Config:
    """The default stage costs scaled up to a larger model's size (both stages' compute grows with
    its parameters), so the printed bound is of this model; below the small preset per-sample
    overheads dominate, and costs the config sets are kept."""
    scale = sizes.shape.params / COSTS_MEASURED_ON if sizes else 1.0
    if scale <= 1.0 or cfg.stage_costs != StageCosts():
        return cfg
    costs = StageCosts(generator_s=cfg.stage_costs.generator_s * scale, learner_s=cfg.stage_costs.learner_s * scale)
    return dataclasses.replace(cfg, stage_costs=costs)


def _by_costs(cfg: Config, devices: int, gpu: bool) -> tuple[Config, str]:
    """Counts and threads from the stage costs (the module doc)."""
    g, learner = cfg.generator, cfg.learner
    unit = g.tensor_parallel if gpu else 1
    evaluator = unit if gpu and cfg.eval.every else 0  # its engine's own GPUs; on CPU it shares
    p = choose_placement(devices - evaluator, cfg.stage_costs.generator_s, cfg.stage_costs.learner_s,
                         shared=not gpu, gen_unit=unit)
    micro_batches = learner.batch_size // (learner.micro_batch * learner.minibatches)
    most = 1 if learner.backend == "torch" else p.learner_devices  # torch: one process
    ranks = max(r for r in range(1, most + 1) if micro_batches % r == 0)
    threads = 1 if gpu else p.learner_devices // ranks
    if gpu and ranks != p.learner_devices and learner.backend == "torch":
        raise ValueError(f"placement: auto gives the learner {p.learner_devices} GPUs, and "
                         "learner.backend=torch trains on one: set learner.backend=deepspeed")
    if gpu and ranks != p.learner_devices:
        raise ValueError(f"placement: auto gives the learner {p.learner_devices} GPUs, but the batch "
                         f"has {micro_batches} micro-batches, which do not split over them: make "
                         f"learner.batch_size a multiple of learner.micro_batch x {p.learner_devices}")
    cfg = dataclasses.replace(
        cfg, placement="manual",
        generator=dataclasses.replace(g, count=p.gen_devices // unit, threads=1, nice=g.nice if gpu else 19),
        learner=dataclasses.replace(learner, ranks=ranks, threads=threads))
    chosen = (f"placement auto: {cfg.generator.count} generator(s) x {unit} "
              f"{'GPU' if gpu else 'thread'}(s){'' if gpu else ' at nice 19'}, learner {ranks} rank(s) x "
              f"{'1 GPU' if gpu else f'{threads} thread(s)'}"
              f"{f', evaluator {evaluator} GPU(s)' if evaluator else ''}; {p.why}")
    return cfg, chosen


# What fits memory when a config does not, fastest first (CPU): more ZeRO sharding costs a
# little communication; gradient checkpointing recomputes the forward (~30% more learner work);
# fewer ranks leave cores to threads, which gain little (module doc). Offload saves nothing on a
# CPU-only machine: all of it is host memory already.
def _candidates(cfg: Config) -> list[Config]:
    lc = cfg.learner
    stages = [s for s in (0, 1, 2, 3) if s >= lc.zero_stage] if lc.backend == "deepspeed" else [lc.zero_stage]
    rank_options = [r for r in range(lc.ranks, 0, -1) if lc.ranks % r == 0]
    out = []
    for ranks in rank_options:
        for checkpointing in sorted({lc.gradient_checkpointing, True}):
            for stage in stages if ranks > 1 else stages[:1]:  # one rank: nothing to shard over
                out.append(dataclasses.replace(cfg, learner=dataclasses.replace(
                    lc, ranks=ranks, threads=lc.threads * lc.ranks // ranks, zero_stage=stage,
                    gradient_checkpointing=checkpointing)))
    return out


def fit_memory(cfg: Config, memory: float, sizes: Sizes, auto: bool) -> tuple[Config | None, MemoryEstimate]:
    """`cfg` as it is if its estimate fits MEMORY_SHARE of `memory`; else, when `auto`, the first
    of _candidates that fits; None if none does. The estimate returned is the config's chosen, or
    (None) the smallest tried."""
    tried = [cfg, *_candidates(cfg)] if auto else [cfg]
    estimates = [estimate(c, sizes) for c in tried]
    for c, est in zip(tried, estimates):
        if est.total <= MEMORY_SHARE * memory:
            return c, est
    return None, min(estimates, key=lambda e: e.total)


def _changes(before: Config, after: Config) -> str:
    keys = ("ranks", "threads", "zero_stage", "gradient_checkpointing")
    return ", ".join(f"learner.{k}={getattr(after.learner, k)}".replace("True", "true").replace("False", "false")
                     for k in keys if getattr(before.learner, k) != getattr(after.learner, k))


def _no_fit(cfg: Config, est: MemoryEstimate, memory: float, sizes: Sizes, auto: bool) -> str:
    need = f"needs an estimated {est.line()}"
    have = f"this machine has {memory / GB:.1f} GiB available (a job may use {MEMORY_SHARE:.0%} of it)"
    model = f"a {sizes.shape.params / 1e9:.2f}B-parameter model"
    if auto:
        return (f"placement: auto finds no setting that fits {model} here: the smallest {need}; {have}. "
                "Free memory, or lower generator.count, generator.max_new_tokens or learner.micro_batch")
    fitted, _ = fit_memory(cfg, memory, sizes, auto=True)
    fix = (f"set {_changes(cfg, fitted)}, or placement=auto to choose" if fitted is not None else
           "free memory, or lower generator.count, generator.max_new_tokens or learner.micro_batch")
    return f"this job on {model} {need}; {have}: {fix}"
