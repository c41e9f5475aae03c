"""Agents that call the model through the OpenAI client (actors/agents.py, actors/openai_server.py):
the prompt ids built from sampled ids, calls folded into one trajectory (or its last chain when
the history was rewritten), rewards and faults; on the real vLLM CPU engine, exact tokens and
log-probs across an in-flight weight update, and the endpoint's key."""

import asyncio
import math
import threading
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.agents import AgentEngine, _reward, chain
from actors.generator import Generator
from actors.model_init import build_bpe_tokenizer
from actors.openai_server import Call, CallRequest, Endpoint, chat_prompt, completion_prompt
from actors.prompts import PromptStream
from actors.rewards import Scorer
from async_rlhf.config import ConfigError, RewardSpec, load_config
from async_rlhf.staleness import StalenessGate
from async_rlhf.types import Prompt, Sample
from helpers import EngineGate
from test_actors_generator import ListQueue

TEMPERATURE = 1.0
FOLLOW_UP = "Go on"


def _call(prompt_ids, response_ids, text, version=0, logprob=-0.5) -> Call:
    ids = np.asarray(response_ids, np.int32)
    return Call(CallRequest(tuple(prompt_ids), "", None),
                Sample(ids, np.full(len(ids), logprob, np.float32), True, ((version, 0),), text=text))


def test_calls_that_extend_each_other_are_one_trajectory_and_a_rewrite_keeps_the_last_chain():
    first = _call([1, 2], [3, 4], "a", version=0)
    second = _call([1, 2, 3, 4, 9, 9], [5], "b", version=1, logprob=-0.25)
    trajectory, left_out = chain([first, second])
    assert (trajectory.prompt_ids, trajectory.ids, left_out) == ([1, 2], [3, 4, 9, 9, 5], 0)
    assert trajectory.observations == [(2, 4)] and trajectory.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.25]
    assert trajectory.versions == [(0, 0), (1, 4)] and trajectory.calls == 2
    rewritten = _call([1, 2, 3, 7, 9], [6], "c")  # the first answer edited: 3 4 -> 3 7
    trajectory, left_out = chain([first, second, rewritten])
    assert (trajectory.prompt_ids, trajectory.ids, trajectory.observations, left_out) == ([1, 2, 3, 7, 9], [6], [], 2)


def test_an_agents_return_value_is_its_reward_or_its_failure():
    assert _reward(0.5) == (0.5, {}) and _reward(None) == (None, {}) and _reward(1) == (1.0, {})
    assert _reward({"reward": 1, "format": 0.5}) == (1.0, {"format": 0.5})
    assert _reward(float("nan"))[0] == "agent_reward_nan" and _reward({"reward": 1, "x": math.inf})[0] == "agent_reward_nan"
    for bad in ("1.0", True, [1.0], {"score": 1.0}, {"reward": 1, "note": "good"}):
        assert _reward(bad)[0] == "agent_bad_reward", bad


def test_history_keeps_the_ids_that_were_sampled_not_a_retokenization():
    """An answer sampled as single characters comes back in the next prompt as those ids, while
    tokenizing its text would merge them (BPE); the sampled end-of-turn token is not doubled."""
    tok = build_bpe_tokenizer()
    text = "count a: 1234"
    sampled = [tok.convert_tokens_to_ids(t) for t in tok.tokenize(text[0])] + [
        i for c in text[1:] for i in tok.encode(c, add_special_tokens=False)] + [tok.eos_token_id]
    assert tok.decode(sampled, skip_special_tokens=True) == text
    assert tok.encode(text, add_special_tokens=False) != sampled[:-1]  # the merged tokenization differs
    user = [{"role": "user", "content": "hi"}]
    first_ids, first_text = chat_prompt(tok, user, None, [])
    assert first_ids == tok.encode(first_text, add_special_tokens=False)
    call = Call(CallRequest(tuple(first_ids), first_text, None),
                Sample(np.asarray(sampled, np.int32), np.zeros(len(sampled), np.float32), True, ((0, 0),), text=text))
    history = user + [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
    ids, _ = chat_prompt(tok, history, None, [call])
    between = tok.encode(f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert ids == first_ids + sampled + between
    edited = history[:1] + [{"role": "assistant", "content": text + "!"}] + history[2:]
    assert chat_prompt(tok, edited, None, [call])[0][:len(first_ids) + len(sampled)] != first_ids + sampled
    # /v1/completions: a prompt that extends an earlier call's prompt and answer keeps its ids
    call = Call(CallRequest((7, 8), "Q:", None), call.sample)
    assert completion_prompt(tok, f"Q:{text}<|im_end|> more", [call])[0] == [7, 8, *sampled, *tok.encode(
        " more", add_special_tokens=False)]


def test_tool_calls_are_parsed_by_the_vllm_parser_env_tool_parser_names():
    tok = build_bpe_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # Hermes' markers, as its models' tokenizers hold them
    endpoint = Endpoint(None, tok, key="k", temperature=TEMPERATURE, host="127.0.0.1", tool_parser="hermes")
    body = {"model": "policy", "messages": [{"role": "user", "content": "3+5?"}], "tools": [{"type": "function",
            "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]}
    message = endpoint._parse_tools(body, 'ok <tool_call>{"name": "calc", "arguments": {"expr": "3+5"}}</tool_call>')
    (call,) = message["tool_calls"]
    assert message["content"] == "ok " and call["function"] == {"name": "calc", "arguments": '{"expr": "3+5"}'}
    assert endpoint._parse_tools(body, "just text") == {"role": "assistant", "content": "just text"}
    with pytest.raises(ValueError, match="env.tool_parser='nope' is not one of vLLM's tool parsers"):
        Endpoint(None, tok, key="k", temperature=TEMPERATURE, host="127.0.0.1", tool_parser="nope")


def test_agent_config_is_checked_once():
    with pytest.raises(ConfigError, match="env.agent"):
        load_config(None, ["env.agent=actors.envs:calculator_agent", "env.target=actors.envs:Calculator"])
    with pytest.raises(ConfigError, match="module:function"):
        load_config(None, ["env.agent=calculator_agent"])
    from async_rlhf.launch.preflight import load_agent

    assert load_agent("actors.envs:calculator_agent")
    with pytest.raises(ConfigError, match="'actors.envs:evaluate' is no agent: it must be `async def"):
        load_agent("actors.envs:evaluate")


# ---- on the real engine ----------------------------------------------------------------------
class Script:
    """Agents' switches: `proceed` holds every agent between its two calls (a test's gate)."""

    proceed = threading.Event()


async def two_calls(client: openai.AsyncOpenAI, prompt: Prompt):
    """Asks, then asks again after its answer (sent back as it came, or edited with `edit`: a
    `!` before it, so that its tokens are no longer the sampled ones);
    prompts that say so raise, hang, return NaN or call with a wrong key or n=2."""
    mode = prompt.text.split(" ")[0]
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    answer = first.choices[0].message.content
    await asyncio.to_thread(Script.proceed.wait, 60)
    if mode == "raise":
        raise RuntimeError("the tool is down")
    if mode == "hang":
        await asyncio.sleep(30)
    messages += [{"role": "assistant", "content": ("!" if mode == "edit" else "") + answer},
                 {"role": "user", "content": FOLLOW_UP}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return math.nan if mode == "nan" else 1.0


@pytest.fixture(scope="module")
def engine(bpe_actor_model):
    from actors.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(bpe_actor_model, max_new_tokens=6, temperature=TEMPERATURE, seed=0)
    yield engine
    engine.close()


def _agents(engine, tok, timeout_s=60.0) -> AgentEngine:
    return AgentEngine(engine, two_calls, tok, max_turns=2, max_tokens=12, max_new_tokens=6,
                       temperature=TEMPERATURE, timeout_s=timeout_s)


@torch.no_grad()
def _recompute(model, prompt_ids, ids: np.ndarray) -> np.ndarray:
    full = torch.tensor([list(prompt_ids) + ids.tolist()])
    logits = model(full).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, full[0, len(prompt_ids):, None])[:, 0].numpy()


@pytest.mark.slow
def test_an_agents_calls_are_one_trajectory_of_sampled_ids_exact_across_an_update(engine, bpe_actor_model):
    """Two episodes of two chat calls; new weights load between them. Each trajectory is the
    first call's prompt, its sampled ids, the text between (masked) and the second call's
    sampled ids; the second call's prompt was exactly that prefix; version_spans names each
    call's weights and every behaviour log-prob equals a recomputation under them. A third
    episode edits its answer before the second call: it trains on the second call only, counted."""
    tok = AutoTokenizer.from_pretrained(bpe_actor_model)
    agents = _agents(engine, tok)
    old = AutoModelForCausalLM.from_pretrained(bpe_actor_model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in old.state_dict().items()}
    new = AutoModelForCausalLM.from_pretrained(bpe_actor_model, dtype=torch.float32).eval()
    new.load_state_dict(new_state)
    base = engine.policy_version
    Script.proceed.clear()
    agents.submit("g", Prompt("p0", (), "ask 3142"), 2)
    agents.submit("e", Prompt("p1", (), "edit 3142"), 1)
    episodes = [*agents._groups["g"].episodes, *agents._groups["e"].episodes]
    while any(not e.calls for e in episodes):
        assert agents.step() == []  # the first calls run; the agents wait between calls
    engine.update_weights(new_state.items(), version=base + 1)
    Script.proceed.set()
    done = {}
    while len(done) < 2:
        done.update(agents.step())
    for e, s in zip(episodes[:2], done["g"]):
        first, second = e.calls
        assert s.reward == 1.0 and s.failure is None and s.text == second.sample.text
        assert s.prompt_ids.tolist() == list(first.prompt_ids)
        response = [*first.sample.response_ids, *second.prompt_ids[len(first.prompt_ids) + len(first.sample.response_ids):],
                    *second.sample.response_ids]
        assert list(second.prompt_ids) == list(first.prompt_ids) + response[:len(response) - len(second.sample.response_ids)]
        assert s.response_ids.tolist() == response
        (obs_start, obs_end), = s.observation_spans
        assert obs_start == len(first.sample.response_ids) and obs_end == len(response) - len(second.sample.response_ids)
        assert FOLLOW_UP in tok.decode(s.response_ids[obs_start:obs_end]) and not s.behavior_logprobs[obs_start:obs_end].any()
        assert s.version_spans == ((base, 0), (base + 1, obs_end)) and s.policy_version == base
        before, after = _recompute(old, s.prompt_ids, s.response_ids), _recompute(new, s.prompt_ids, s.response_ids)
        assert np.abs(before[:obs_start] - s.behavior_logprobs[:obs_start]).max() <= 1e-3
        assert np.abs(after[obs_end:] - s.behavior_logprobs[obs_end:]).max() <= 1e-3
        assert np.abs(before[obs_end:] - s.behavior_logprobs[obs_end:]).max() > 1e-2  # told apart
    (edited,) = done["e"]
    first, second = episodes[2].calls
    assert edited.prompt_ids.tolist() == list(second.prompt_ids) and edited.observation_spans == ()
    assert edited.response_ids.tolist() == second.sample.response_ids.tolist() and agents.rewrites == 1
    assert agents.episodes == 3 and agents.turns == 6 and not engine.num_sequences
    engine.update_weights(old.state_dict().items(), version=base + 2)


@pytest.mark.slow
def test_agents_that_raise_hang_or_return_nan_are_set_aside_and_the_endpoint_wants_its_key(engine, bpe_actor_model):
    tok = AutoTokenizer.from_pretrained(bpe_actor_model)
    Script.proceed.set()
    agents = _agents(engine, tok, timeout_s=4.0)  # the hanging agent sleeps 30 s; the others need ~0.2
    agents.submit("open", Prompt("p", (), "ask 1"), 1)  # an open episode: the key is checked before it
    url = agents.endpoint.base_url(agents._groups["open"].episodes[0].token)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}])
    keyless = urllib.request.Request(f"{url}/completions", data=b'{"prompt": "hi"}', method="POST")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(keyless, timeout=30)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        openai.OpenAI(base_url=url, api_key=agents.endpoint.key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], n=2)
    agents.abort(["open"])
    records = [("hang 1", ""), ("raise 2", ""), ("nan 3", "")] + [(f"ask {i}", "") for i in range(4)]
    queue, gate = ListQueue(), EngineGate(StalenessGate(max_staleness=0, batch_size=14), lambda: engine.policy_version)
    generator = Generator(agents, PromptStream(records, tok, seed=0), Scorer.from_specs([RewardSpec(
        target="actors.tasks:score")]), queue, gate, group_size=2, max_inflight=8, poll_s=0.01)
    stats = generator.run(threading.Event(), max_groups=7)
    assert stats.set_aside == {"agent_timeout": 1, "agent_raised": 1, "agent_reward_nan": 1}
    assert sorted(reason for reason, _, _ in queue.dead) == ["agent_raised", "agent_reward_nan", "agent_timeout"]
    assert stats.groups == 4 and len(queue.samples()) == 8 and stats.turns >= 8 * 2
    assert all(t.reward == 1.0 and len(t.observation_spans) == 1 for t in queue.samples())
    assert not engine.num_sequences
