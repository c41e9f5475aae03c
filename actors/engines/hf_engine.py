"""GenerationEngine on plain transformers `generate`, for machines without vLLM (and as the
benchmark's baseline).

No continuous batching: `step` generates every group submitted since the last step to its end,
in one `generate` call per sample count n, so a generator on this engine works in lock-step
batches (of up to generator.max_inflight sequences) whatever generator.schedule says, and
weights change only between those batches.

Log-probs come from `generate`'s processed scores: log_softmax of the logits after temperature
and, when top_p < 1, the top-p mask, i.e. the distribution each token was sampled from, the same
convention as the vLLM engine (see vllm_engine.py for what top_p < 1 means to the learner).

Ends of a response, as in the vLLM engine: the EOS token and the generation config's other end
tokens (a chat model's end-of-turn token) end it, kept in the ids and log-probs, not written in
the text. Stop strings (generator.stop) follow vLLM's rule, not transformers' `stop_strings`
(whose StopStringCriteria matches token strings over the whole sequence, prompt included, so it
could end a response where vLLM would not): a row ends at the first token after which its
response's decoded text holds a stop string; that token is kept with its log-prob, and the text
ends before the stop string (the earliest-completing one). The criterion records the length at
which each row ended, so nothing has to be guessed from the padding after it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from async_rlhf.messages import SyncAddress
from async_rlhf.procs import LOOPBACK
from async_rlhf.types import Prompt, Sample, VersionSpans
from async_rlhf.weight_sync import StagedReceiver, UpdateMeta, mismatch


def _before_stop(text: str, stop: Sequence[str]) -> str | None:
    """`text` cut before the stop string that completes first in it (ties: the first listed, as
    vLLM picks), or None when it holds none."""
    found = [(text.find(s) + len(s), i) for i, s in enumerate(stop) if s in text]
    if not found:
        return None
    end, i = min(found)
    return text[: end - len(stop[i])]


class _StopStrings(StoppingCriteria):
    """Ends a row of `generate` once its response (tokens after column `width`) decodes to text
    holding a stop string; `lengths[row]` is then its response length."""

    def __init__(self, tokenizer, stop: Sequence[str], width: int):
        self.tokenizer, self.stop, self.width = tokenizer, stop, width
        self.lengths: dict[int, int] = {}

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        for row, ids in enumerate(input_ids):
            if row not in self.lengths:
                text = self.tokenizer.decode(ids[self.width:], skip_special_tokens=True)
                if _before_stop(text, self.stop) is not None:
                    self.lengths[row] = len(ids) - self.width
        return torch.tensor([row in self.lengths for row in range(len(input_ids))], device=input_ids.device)


class HFEngine:
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
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.to(self.device).eval()
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.temperature = temperature
        self.top_p = top_p
        self.threads = threads
        self.eos_token_id = self.tokenizer.eos_token_id
        ends = self.model.generation_config.eos_token_id
        ends = [ends] if isinstance(ends, int) else list(ends or [])
        self.end_token_ids = list(dict.fromkeys([self.eos_token_id, *ends]))  # vLLM stops at these
        self.pad_token_id = self.tokenizer.pad_token_id
        self._sync = StagedReceiver(self.update_weights)
        self._version = 0
        self._submitted: dict[str, tuple[Prompt, int]] = {}

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def num_sequences(self) -> int:
        return sum(n for _, n in self._submitted.values())

    def submit(self, key: str, prompt: Prompt, n: int) -> None:
        self._submitted[key] = (prompt, n)

    def step(self) -> list[tuple[str, list[Sample]]]:
        """Every group submitted since the last step, generated to its end."""
        submitted, self._submitted = self._submitted, {}
        done = []
        for n in sorted({n for _, n in submitted.values()}):
            keys = [k for k, (_, m) in submitted.items() if m == n]
            done += zip(keys, self.generate([submitted[k][0] for k in keys], n))
        return done

    def abort(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._submitted.pop(key, None)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Prompt], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        """n samples per prompt; `greedy` (tests, evaluation) takes the argmax token instead."""
        width = max(len(p.token_ids) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[i, width - len(p.token_ids):] = torch.tensor(p.token_ids)
            mask[i, width - len(p.token_ids):] = 1
        sampling = {} if greedy else {"temperature": self.temperature, "top_p": self.top_p}
        stops = _StopStrings(self.tokenizer, self.stop, width)
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=self.max_new_tokens,
            do_sample=not greedy,
            top_k=0,  # no top-k: the only truncation is top_p, as in the vLLM engine
            num_return_sequences=n,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=self.end_token_ids,
            pad_token_id=self.pad_token_id,
            stopping_criteria=StoppingCriteriaList([stops] if self.stop else []),
            **sampling,
        )
        tokens = out.sequences[:, width:].cpu()
        logprobs = torch.stack(
            [torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1
        ).cpu()  # [B*n, T, V]
        picked = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        spans = ((self._version, 0),)
        samples = [self._sample(tokens[j], picked[j], spans, stops.lengths.get(j))
                   for j in range(len(tokens))]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _sample(self, tokens: torch.Tensor, logprobs: torch.Tensor, spans: VersionSpans,
                stopped: int | None) -> Sample:
        """Row `tokens` up to its first end token or, where `stopped`, its first `stopped`
        tokens: all kept (they were sampled); the text leaves the end token out, as vLLM does."""
        end = torch.isin(tokens, torch.tensor(self.end_token_ids)).nonzero()
        length = stopped or (int(end[0]) + 1 if len(end) else len(tokens))
        ids = tokens[:length].numpy().astype(np.int32)
        written = length - bool(len(end) and not stopped)  # the end token is not
        text = self.tokenizer.decode(ids[:written], skip_special_tokens=True)
        return Sample(
            response_ids=ids,
            behavior_logprobs=logprobs[:length].numpy().astype(np.float32),
            finished=bool(stopped or len(end)),
            version_spans=spans,
            text=_before_stop(text, self.stop) if stopped else text,
        )

    sync_ranks = 1  # this process receives the weight broadcasts

    def join_weight_sync(self, address: SyncAddress, rank: int, host: str = LOOPBACK) -> None:
        self._sync.join(address, rank, host)

    def receive_weights(self, meta: UpdateMeta, load: bool, keep: Iterable[int] = ()) -> int:
        return self._sync.receive(meta, load, keep)

    def load_staged(self, version: int) -> None:
        self._sync.load(version)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy full HF-named weights into the model in place, then generate as `version`; an
        update that names a tensor the model lacks, leaves one out or has another shape raises
        WeightMismatchError before anything is copied."""
        params = dict(self.model.named_parameters())
        named = list(named_tensors)
        names = {name for name, _ in named}
        shapes = [f"{n} {tuple(t.shape)} (the model's {tuple(params[n].shape)})" for n, t in named
                  if n in params and t.shape != params[n].shape]
        if names != set(params) or shapes:
            raise mismatch(version, unknown=names - set(params), unloaded=set(params) - names,
                           detail=f"other shapes: {', '.join(shapes)}" if shapes else "")
        for name, tensor in named:
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        self._version = version
