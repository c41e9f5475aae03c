"""Multi-turn episodes on the real vLLM CPU engine (actors/episodes.py): turns and observations
in one sample, the observations masked, behaviour log-probs exact across a weight update
between turns, and environments that hang or raise set aside while the generator goes on."""

import asyncio
import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.envs import Calculator, GuessNumber, evaluate
from actors.episodes import EpisodeEngine
from actors.generator import Generator
from actors.prompts import PromptStream
from actors.rewards import Scorer
from async_rlhf.config import RewardSpec
from async_rlhf.staleness import StalenessGate
from async_rlhf.types import Prompt
from helpers import EngineGate
from test_actors_generator import ListQueue

OBSERVATION = " ok: "
TEMPERATURE = 1.0


class Scripted:
    """Replies OBSERVATION to each turn and ends after the third with reward 1. Before replying
    to the first turn it waits for `first_turns` (a test's gate); prompts that say so hang or
    raise."""

    first_turns = threading.Event()

    def __init__(self):
        self.turns = 0

    def reset(self, prompt: Prompt) -> str:
        self.mode = prompt.text.split(" ")[0]
        return ""

    def step(self, response: str):
        self.turns += 1
        if self.turns == 1:
            assert self.first_turns.wait(60)
        if self.mode == "raise":
            raise RuntimeError("the tool is down")
        if self.mode == "hang":
            threading.Event().wait(5)
        return OBSERVATION, self.turns == 3, 1.0 if self.turns == 3 else None


@pytest.fixture(scope="module")
def engine(tiny_actor_model):
    from actors.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_actor_model, max_new_tokens=4, temperature=TEMPERATURE, seed=0)
    yield engine
    engine.close()


def _prompt(tok, text: str, i: int = 0) -> Prompt:
    return Prompt(f"p{i}", tuple(tok(text)["input_ids"]), text, "")


@torch.no_grad()
def _recompute(model, prompt: Prompt, ids: np.ndarray) -> np.ndarray:
    """log pi(token t | everything before it) for each response token, as the learner computes."""
    full = torch.tensor([list(prompt.token_ids) + ids.tolist()])
    logits = model(full).logits[0, len(prompt.token_ids) - 1:-1].float()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, full[0, len(prompt.token_ids):, None])[:, 0].numpy()


@pytest.mark.slow
def test_an_episode_holds_every_turn_its_observations_masked_and_exact_across_an_update(engine, tiny_actor_model):
    """Two episodes of 3 turns; new weights load while both wait for their environment after the
    first turn. Each sample holds turns and observations; the observations are named by
    observation_spans with log-prob 0; version_spans names the version of each turn, and every
    sampled token's behaviour log-prob equals a recomputation under that version."""
    tok = AutoTokenizer.from_pretrained(tiny_actor_model)
    episodes = EpisodeEngine(engine, Scripted, tok, max_turns=3, max_tokens=64, max_new_tokens=4, timeout_s=60)
    old = AutoModelForCausalLM.from_pretrained(tiny_actor_model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in old.state_dict().items()}
    new = AutoModelForCausalLM.from_pretrained(tiny_actor_model, dtype=torch.float32).eval()
    new.load_state_dict(new_state)
    base, prompt = engine.policy_version, _prompt(tok, "copy 3142=")
    Scripted.first_turns.clear()
    episodes.submit("g", prompt, 2)
    while any(e.turns == 0 for e in episodes._groups["g"].episodes):
        assert episodes.step() == []  # first turns run; the environment holds its replies
    engine.update_weights(new_state.items(), version=base + 1)  # between turns 1 and 2
    Scripted.first_turns.set()
    done = []
    while not done:
        done = episodes.step()
    ((key, samples),) = done
    obs = tok.encode(OBSERVATION, add_special_tokens=False)
    for s in samples:
        assert s.reward == 1.0 and s.finished and s.failure is None
        assert len(s.observation_spans) == 2  # after turns 1 and 2; none after the last
        mask = np.ones(len(s.response_ids), bool)
        for start, end in s.observation_spans:
            assert s.response_ids[start:end].tolist() == obs and not s.behavior_logprobs[start:end].any()
            mask[start:end] = False
        first_end = s.observation_spans[0][0]
        assert s.version_spans == ((base, 0), (base + 1, s.observation_spans[0][1]))
        assert s.policy_version == base  # staleness: the first token's
        assert s.text == tok.decode(s.response_ids, skip_special_tokens=True)
        before, after = _recompute(old, prompt, s.response_ids), _recompute(new, prompt, s.response_ids)
        assert np.abs(before[:first_end] - s.behavior_logprobs[:first_end]).max() <= 1e-3
        later = mask.copy()
        later[:first_end] = False
        assert np.abs(after[later] - s.behavior_logprobs[later]).max() <= 1e-3
        assert np.abs(old_wrong := before[later] - s.behavior_logprobs[later]).max() > 1e-2, old_wrong  # told apart
    engine.update_weights(old.state_dict().items(), version=base + 2)


@pytest.mark.slow
def test_environments_that_hang_or_raise_are_set_aside_and_the_generator_goes_on(engine, tiny_actor_model):
    tok = AutoTokenizer.from_pretrained(tiny_actor_model)
    Scripted.first_turns.set()
    episodes = EpisodeEngine(engine, Scripted, tok, max_turns=3, max_tokens=64, max_new_tokens=4, timeout_s=1.0)
    records = [("hang 1=", ""), ("raise 2=", "")] + [(f"copy {i}=", "") for i in range(6)]
    queue, gate = ListQueue(), EngineGate(StalenessGate(max_staleness=0, batch_size=16), lambda: engine.policy_version)
    generator = Generator(episodes, PromptStream(records, tok, seed=0), Scorer.from_specs([RewardSpec(
        target="actors.tasks:score")]), queue, gate, group_size=2, max_inflight=8, poll_s=0.01)
    stats = generator.run(threading.Event(), max_groups=8)
    assert stats.set_aside == {"env_timeout": 1, "env_raised": 1}
    assert stats.groups == 6 and stats.produced == 12 == len(queue.samples())
    assert sorted(reason for reason, _, _ in queue.dead) == ["env_raised", "env_timeout"]
    assert stats.episodes == 16 and stats.turns >= 6 * 2 * 3 and stats.env_s >= 1.0  # the hang's timeout
    assert all(t.reward == 1.0 and t.reward_parts == {"env": 1.0} and len(t.observation_spans) == 2
               for t in queue.samples())
    assert not engine.num_sequences


def test_builtin_environments_score_what_they_say():
    assert evaluate("3+5") == 8 and evaluate("12-20") == -8 and evaluate("3*5") is None

    async def play(env, prompt, turns):
        await env.reset(prompt)
        return [await env.step(turn) for turn in turns]

    calc = Prompt("c", (1,), "calc 3+5=", "8")
    assert asyncio.run(play(Calculator(), calc, ["?", "8"])) == [("=8 ", False, 0.0), ("", True, 1.0)]
    assert asyncio.run(play(Calculator(), calc, ["2+2?", "4"]))[0] == ("=4 ", False, 0.0)
    assert asyncio.run(play(Calculator(), calc, ["9"]))[-1] == ("", True, 0.1)  # no call; right length only
    guess = Prompt("g", (1,), "guess 123=", "3")
    assert asyncio.run(play(GuessNumber(), guess, ["x", "1", "4", "a3"])) == [
        ("digit? ", False, 0.0), ("higher ", False, 0.0), ("lower ", False, 0.0), ("", True, 0.25)]
