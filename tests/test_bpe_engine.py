"""The engines on a real byte-level BPE tokenizer with a ChatML template (the tiny preset,
model.tokenizer=bpe), where tokens merge across word and prompt/response boundaries and
decoding is not a plain join: chat prompts as the template writes them, log-probs against
transformers, a stop string spanning two tokens, <|im_end|> kept in the ids but not in the
text, and the learner's batch holding exactly the generator's ids (nothing decoded and
tokenized again), through the real vLLM CPU engine, generator, Redis stream and codec."""

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines import make_engine
from actors.engines.hf_engine import HFEngine
from actors.generator import make_generator
from actors.model_init import IM_END
from actors.prompts import make_prompt_stream
from async_rlhf.config import Config, DataConfig, GeneratorConfig, ModelConfig
from async_rlhf.staleness import StalenessGate
from async_rlhf.types import Group, Received, Trajectory
from helpers import EngineGate
from learners.batch import Batch
from learners.models import response_view

TEMPERATURE = 0.7
MAX_NEW = 12
SYSTEM = "You answer with the letter a."


@pytest.fixture(scope="module")
def tok(bpe_actor_model):
    return AutoTokenizer.from_pretrained(bpe_actor_model)


@pytest.fixture(scope="module")
def model(bpe_actor_model):
    return AutoModelForCausalLM.from_pretrained(bpe_actor_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(tok):
    """count prompts as conversations: four with a system message (as configs/chat.yaml has
    them), four without."""
    return [p for system in (SYSTEM, "")
            for p in make_prompt_stream(DataConfig(task="count", system_prompt=system, chat_template="on"),
                                        tok, seed=0).take(4)]


def _engine(kind, path):
    # float32: the log-probs are checked against transformers' to float32 precision
    cfg = GeneratorConfig(engine=kind, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, dtype="float32")
    return make_engine(cfg, path, seed=0)


@pytest.fixture(scope="module")
def vllm_engine(bpe_actor_model):
    engine = _engine("vllm", bpe_actor_model)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(bpe_actor_model):
    return _engine("hf", bpe_actor_model)


@pytest.fixture(params=["vllm", "hf"])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


@torch.no_grad()
def _recompute(model, prompt_ids, response_ids, temperature):
    """What the learner computes: log_softmax(logits / T) at each response token."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, ids[0, len(prompt_ids):, None]).squeeze(-1).numpy()


def test_chat_prompts_render_as_the_template_says(chat_prompts, tok):
    p = chat_prompts[0]
    assert p.text == (f"<bos><|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{p.query}"
                      "<|im_end|>\n<|im_start|>assistant\n")
    assert [m["role"] for m in p.messages] == ["system", "user"] and p.query.startswith("count a: ")
    # the ids are transformers' own rendering, with every marker one special token
    assert list(p.token_ids) == tok.apply_chat_template(list(p.messages), add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
    tokens = tok.convert_ids_to_tokens(p.token_ids)
    assert tokens[:2] == ["<bos>", "<|im_start|>"] and tokens.count(IM_END) == 2
    assert tok.decode(p.token_ids) == p.text
    # byte-level BPE: far fewer tokens than characters
    assert len(p.token_ids) < 0.6 * len(p.text)


def test_logprobs_match_transformers_on_chat_prompts(engine, chat_prompts, model, tok):
    groups = engine.generate(chat_prompts, n=3)
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert engine.eos_token_id == im_end
    diffs = []
    for p, group in zip(chat_prompts, groups):
        for s in group:
            assert s.behavior_logprobs.shape == s.response_ids.shape and 1 <= len(s.response_ids) <= MAX_NEW
            assert s.finished == (s.response_ids[-1] == im_end) and im_end not in s.response_ids[:-1]
            diffs.append(np.abs(_recompute(model, p.token_ids, s.response_ids, TEMPERATURE)
                                - s.behavior_logprobs).max())
    assert max(diffs) <= 1e-3, f"max |engine - transformers| log-prob = {max(diffs):.2e}"


def _two_token_stop(tok, ids):
    """(stop, i): the text that tokens i and i + 1 of `ids` write, chosen where that text first
    occurs in the response's text, so that as a stop string it completes at token i + 1 and not
    before (both tokens write something; the text so far is clean: no partial UTF-8
    characters); None if `ids` has no such pair."""
    texts = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    for i in range(1, len(ids) - 1):
        before, one, two = texts[i:i + 3]
        stop = two[len(before):]
        if "\ufffd" not in two and len(before) < len(one) < len(two) and two.find(stop) == len(before):
            return stop, i
    return None


def test_a_stop_string_spanning_two_tokens_ends_the_response_after_them(engine, chat_prompts, model, tok):
    """Greedy once; then with the text of two consecutive tokens as stop string the response
    ends right after the second (both kept, with their log-probs), its text before the stop."""
    greedy = [g[0] for g in engine.generate(chat_prompts, 1, greedy=True)]
    found = [(p, s, _two_token_stop(tok, s.response_ids.tolist())) for p, s in zip(chat_prompts, greedy)]
    found = [(p, s, *pair) for p, s, pair in found if pair is not None]
    assert found, "no greedy response has two tokens usable as a stop string"
    prompt, first, stop, i = found[0]
    engine.stop = (stop,)
    try:
        (group,) = engine.generate([prompt], 1, greedy=True)
    finally:
        engine.stop = ()
    (s,) = group
    assert s.response_ids.tolist() == first.response_ids.tolist()[:i + 2]
    assert s.finished and s.text == tok.decode(first.response_ids[:i], skip_special_tokens=True)
    assert stop not in s.text and stop in tok.decode(s.response_ids, skip_special_tokens=True)
    assert s.behavior_logprobs.shape == s.response_ids.shape  # the completing token's is there
    recomputed = _recompute(model, prompt.token_ids, s.response_ids, 1.0)  # greedy: temperature 1
    assert np.abs(recomputed - s.behavior_logprobs).max() <= 1e-3


def test_im_end_ends_the_turn_kept_in_ids_not_in_text(engine, chat_prompts, model, tok):
    """<|im_end|>'s output row made twice that of the token greedy picks at step 4: it becomes
    the argmax there (that token's logit, the largest of 512, is positive) or earlier, ends the
    response, stays in its ids with its log-prob, and is not written in its text."""
    im_end = tok.convert_tokens_to_ids(IM_END)
    greedy = engine.generate(chat_prompts, 1, greedy=True)
    prompt, first = next((p, s) for p, (s,) in zip(chat_prompts, greedy)  # 5 tokens of clean text
                         if len(s.response_ids) == MAX_NEW and "\ufffd" not in tok.decode(s.response_ids[:5]))
    assert im_end not in first.response_ids.tolist()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    edited = dict(original)
    edited["lm_head.weight"] = original["lm_head.weight"].clone()
    edited["lm_head.weight"][im_end] = 2 * original["lm_head.weight"][first.response_ids[4]]
    engine.update_weights(edited.items(), version=engine.policy_version + 1)
    try:
        ((s,),) = engine.generate([prompt], 1, greedy=True)
    finally:
        engine.update_weights(original.items(), version=engine.policy_version + 1)
    ids = s.response_ids.tolist()
    assert ids[-1] == im_end and ids[:-1] == first.response_ids.tolist()[:len(ids) - 1] and len(ids) <= 5
    assert s.finished and s.text == tok.decode(ids[:-1], skip_special_tokens=True) and IM_END not in s.text
    model.load_state_dict(edited)
    try:
        assert np.abs(_recompute(model, prompt.token_ids, ids, 1.0) - s.behavior_logprobs).max() <= 1e-3
    finally:
        model.load_state_dict(original)


def test_hf_engine_ends_at_every_end_token_of_the_generation_config(hf_engine, chat_prompts, tok, tmp_path,
                                                                    bpe_actor_model):
    """Chat models list their end-of-turn token among generation_config.eos_token_id, which
    vLLM stops at: so does the HF engine, keeping the token in the ids but not in the text."""
    prompt = chat_prompts[-1]
    ((first,),) = hf_engine.generate([prompt], 1, greedy=True)
    ids = first.response_ids.tolist()
    end = ids[len(ids) // 2]
    k = ids.index(end)
    model_dir = Path(shutil.copytree(bpe_actor_model, tmp_path / "model"))
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [hf_engine.eos_token_id, end]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    ((s,),) = HFEngine(model_dir, max_new_tokens=MAX_NEW).generate([prompt], 1, greedy=True)
    assert s.response_ids.tolist() == ids[:k + 1] and s.finished
    assert s.text == tok.decode(ids[:k], skip_special_tokens=True)
    assert np.array_equal(s.behavior_logprobs, first.behavior_logprobs[:k + 1])


def _crosses_boundary(tok, prompt_ids, response_ids) -> bool:
    """Whether tokenizing the decoded prompt + response text again gives a token across the
    prompt/response boundary (so other ids than these, and another boundary)."""
    text, cut = tok.decode(prompt_ids + response_ids), len(tok.decode(prompt_ids))
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    crosses = any(a < cut < b for a, b in encoded["offset_mapping"])
    assert not crosses or encoded["input_ids"] != prompt_ids + response_ids
    return crosses


@pytest.mark.slow
def test_the_learner_trains_on_the_generators_ids(vllm_engine, bpe_actor_model, tok, model,
                                                  redis_server, stream_name, tmp_path):
    """Greedy generations (temperature 0: the test knows what the engine generates) for plain
    prompts that end mid-word, and a conversation, go through the generator, the Redis stream
    and the codec into the learner's batch: every row is the rendered prompt's ids followed by
    the engine's ids, and the learner's log-probs at the batch's positions, under its mask,
    are the behaviour log-probs. Tokenizing the decoded text again would give other ids, at
    the prompt/response boundary too ("reverse 9= co" + "unt" -> "count"), and such a row
    keeps its ids through the stream as well."""
    import redis

    from buffer.redis_stream import RedisExperienceQueue

    plain = [f"{task} {word}" for task in ("count a: 4=", "echo 2=", "reverse 9=", "copy 31=")
             for word in ("co", "c", "rev", "ec", "4")]
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "count a: 48="}]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in plain + [conversation]))
    cfg = Config(model=ModelConfig(path=str(bpe_actor_model), tokenizer="bpe"),
                 data=DataConfig(source="jsonl", path=str(path)),
                 generator=GeneratorConfig(group_size=1, max_inflight=8, max_new_tokens=MAX_NEW))
    client = redis.Redis.from_url(redis_server.url, decode_responses=False)
    producer, consumer = (RedisExperienceQueue(client, name, stream=stream_name)
                          for name in ("gen-0", "learner"))
    gate = EngineGate(StalenessGate(max_staleness=0, batch_size=len(plain) + 1), lambda: 0)
    gen = make_generator(cfg, producer, gate, engine=vllm_engine)
    prompts = {p.prompt_id: p for p in gen.prompts.prompts}
    vllm_engine.temperature = 0.0
    try:
        assert gen.run(threading.Event(), max_groups=len(prompts)).produced == len(prompts)
    finally:
        vllm_engine.temperature = TEMPERATURE
    items: list[Received] = consumer.get(len(prompts) + 1, block_ms=2000)
    assert len(items) == len(prompts)
    batch = Batch.from_received(items)
    rows = [prompts[r.group.group_id.rsplit("/", 1)[1]] for r in items]  # group id: gen/taken/prompt id
    assert {p.text for p in rows if not p.messages} == set(plain) and sum(bool(p.messages) for p in rows) == 1
    expected = vllm_engine.generate(rows, 1, greedy=True)  # the engine's ids, asked directly
    for i, (p, (sample,)) in enumerate(zip(rows, expected)):
        ids = list(p.token_ids) + sample.response_ids.tolist()
        R = len(sample.response_ids)
        assert batch.input_ids[i, :len(ids)].tolist() == ids and batch.attention_mask[i].sum() == len(ids)
        assert batch.mask[i].sum() == R
    # The boundary where re-tokenizing would merge ("reverse 9= co" + "unt" -> "count"), made
    # certain rather than hoped for from the random model: such a response crosses the same
    # stream and codec into the batch with its ids as they are.
    prompt = next(p for p in rows if p.text == "reverse 9= co")
    unt = tok("unt", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(IM_END)]
    assert _crosses_boundary(tok, list(prompt.token_ids), unt)
    producer.put([Group((Trajectory(
        prompt_ids=np.asarray(prompt.token_ids, dtype=np.int32), response_ids=np.asarray(unt, dtype=np.int32),
        behavior_logprobs=np.full(len(unt), -1.0, dtype=np.float32), reward=0.0, reward_parts={},
        policy_version=0, generator_id="gen-0", group_id="gen-0/boundary", finished=True),))])
    (item,) = consumer.get(1, block_ms=2000)
    merged = Batch.from_received([item])
    assert merged.input_ids[0].tolist()[:len(prompt.token_ids) + len(unt)] == list(prompt.token_ids) + unt
    assert merged.mask[0].sum() == len(unt)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(response_view(logits, batch.positions).float(), dim=-1)
    logp = logp.gather(-1, batch.input_ids.gather(1, batch.positions + 1)[..., None]).squeeze(-1)
    assert ((logp - batch.behavior_logp).abs() * batch.mask).max() <= 1e-3
