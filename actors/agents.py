"""Episodes played by agents: plain async functions that call the model through the OpenAI client.

With env.agent naming `module:function`,

    async def agent(client: openai.AsyncOpenAI, prompt: Prompt) -> float | dict | None

`AgentEngine` wraps the generator's engine and is a GenerationEngine itself, as EpisodeEngine is
(actors/episodes.py): the generator's loop, staleness gate, whole-group puts and weight updates
are unchanged. `submit(key, prompt, n)` starts n episodes; for each, the agent is called with a
client whose base URL routes its calls to this generator's endpoint (actors/openai_server.py)
under the episode's own path, and whose key is the endpoint's. Each call's prompt ids go to the
wrapped engine as one request, continuously batched with everything else and sampled by
whatever weights are loaded when each token is sampled (in-flight updates included).

An episode's trajectory is built from its calls once the agent returns (`chain`): a call whose
prompt ids start with the trajectory so far (prompt, earlier completions, the text between)
extends it: the new text between is an observation (loss mask 0, log-prob 0) and its completion
is trained. That is every call of an agent that sends back the answers it got (the endpoint puts
the sampled ids in for them). A call whose prompt does not extend it (the agent rewrote or
edited its history, or made calls side by side) starts the trajectory again from that call: the
episode trains on its last chain of calls, the one that led to its answer, and the calls before
are left out and counted (`rewrites`). So no id that was not sampled is ever trained on, and
each episode stays one trajectory of its group.

Reward: the agent's return value, a number or a dict {"reward": number, <part>: number ...}
(its parts are logged); None has the configured rewards score the last call's text. An agent
that raises, takes over env.timeout_s, returns anything else or a non-finite reward, or makes
no call, fails its episode: the group comes back at once with the failure (agent_raised,
agent_timeout, agent_bad_reward, agent_reward_nan, agent_no_call), its open calls aborted and its
other agents cancelled; the generator sets it aside and counts it. env.max_turns caps an
episode's calls and env.max_tokens the tokens its calls may sample in all: a call past either
gets an HTTP 400 that says so.

The agents and the endpoint run on an asyncio loop in a thread of their own; the engine is
touched only from the generator's engine loop (`step`), which takes the calls from a queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue

import numpy as np

from async_rlhf.config import Config
from async_rlhf.procs import LOOPBACK
from async_rlhf.protocols import GenerationEngine
from async_rlhf.types import Prompt, Sample

from actors.engines import generate_all
from actors.openai_server import Call, CallRequest, Endpoint, EndpointError


@dataclass
class Chain:
    """A trajectory built from calls: the first call's prompt, then completions and the text
    between them (observations)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    observations: list[tuple[int, int]] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)
    calls: int = 0


def chain(calls: Sequence[Call]) -> tuple[Chain, int]:
    """The last chain of `calls` (in the order they were sampled) and how many calls were left
    out of it because a later call's prompt did not extend theirs (see the module doc)."""
    current, left_out = None, 0
    for call in calls:
        prompt = list(call.prompt_ids)
        if current is not None and prompt[:len(current.prompt_ids) + len(current.ids)] == current.prompt_ids + current.ids:
            between = prompt[len(current.prompt_ids) + len(current.ids):]
            if between:
                current.observations.append((len(current.ids), len(current.ids) + len(between)))
                current.ids += between
                current.logprobs += [0.0] * len(between)
        else:
            left_out += current.calls if current is not None else 0
            current = Chain(prompt)
        start = len(current.ids)
        for version, offset in call.sample.version_spans:
            if not current.versions:
                current.versions.append((version, 0))
            elif version != current.versions[-1][0]:
                current.versions.append((version, start + offset))
        current.ids += call.sample.response_ids.tolist()
        current.logprobs += call.sample.behavior_logprobs.tolist()
        current.calls += 1
    return current, left_out


@dataclass
class _Episode:
    group: str
    index: int
    token: str = field(default_factory=lambda: secrets.token_hex(8))  # its path on the endpoint
    calls: list[Call] = field(default_factory=list)  # sampled, in order (the agents' loop writes it)
    started: int = 0  # calls sent to the engine (the agents' loop)
    budget: int = 0  # tokens its calls may still sample
    run: concurrent.futures.Future | None = None  # the agent's coroutine
    ended: bool = False
    sample: Sample | None = None


@dataclass
class _Group:
    episodes: list[_Episode]
    greedy: bool
    turns: set[str] = field(default_factory=set)  # its requests in the engine


class AgentEngine:
    """A GenerationEngine whose groups are agent episodes (see the module doc); weights,
    versions and the weight-sync group are the wrapped engine's."""

    def __init__(self, engine: GenerationEngine, agent: Callable, tokenizer, *, max_turns: int,
                 max_tokens: int, max_new_tokens: int, temperature: float, timeout_s: float,
                 host: str = LOOPBACK, tool_parser: str = "", poll_s: float = 0.05):
        self.engine, self.agent, self.tokenizer = engine, agent, tokenizer
        self.max_turns, self.max_tokens, self.max_new_tokens = max_turns, max_tokens, max_new_tokens
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._groups: dict[str, _Group] = {}  # engine loop
        self._open: dict[str, _Episode] = {}  # token -> episode, for the endpoint
        self._turns: dict[str, tuple[_Episode, CallRequest, asyncio.Future]] = {}  # engine request key -> its call
        self._events: SimpleQueue[tuple] = SimpleQueue()  # calls and ended agents, for the engine loop
        self._keys = itertools.count()
        self.episodes = self.turns = self.rewrites = 0  # of the episodes returned (step)
        self.env_s = 0.0  # seconds agents ran, summed over episodes
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="agent-loop", daemon=True).start()
        self.endpoint = Endpoint(self, tokenizer, key=secrets.token_urlsafe(24), temperature=temperature,
                                 host=host, tool_parser=tool_parser)
        asyncio.run_coroutine_threadsafe(self.endpoint.start(), self._loop).result(60)

    def __getattr__(self, name: str):
        if name == "engine":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)  # weights, versions, sync_ranks ...

    @property
    def num_sequences(self) -> int:
        return self.engine.num_sequences

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.endpoint.close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.engine.close()

    # -- GenerationEngine ------------------------------------------------------------------
    def submit(self, key: str, prompt: Prompt, n: int, *, greedy: bool = False) -> None:
        group = self._groups[key] = _Group([_Episode(key, i, budget=self.max_tokens) for i in range(n)], greedy)
        for episode in group.episodes:
            self._open[episode.token] = episode
            episode.run = asyncio.run_coroutine_threadsafe(self._play(episode, prompt), self._loop)
            episode.run.add_done_callback(lambda _, e=episode: self._events.put(("ended", e)))

    def step(self) -> list[tuple[str, list[Sample]]]:
        """One engine step (or, with nothing in the engine, a wait of up to poll_s for a call),
        then every call and ended agent that came meanwhile; the groups that ended."""
        events = []
        if self.engine.num_sequences:
            for key, (sample,) in self.engine.step():
                episode, request, future = self._turns.pop(key)
                self._groups[episode.group].turns.discard(key)
                self._settle(future, Call(request, sample))
        else:
            try:
                events.append(self._events.get(timeout=self.poll_s))
            except Empty:
                pass
        while not self._events.empty():
            events.append(self._events.get())
        for kind, episode, *call in events:
            if kind == "call":
                self._start_call(episode, *call)
            elif episode.group in self._groups and not episode.ended:
                self._ended(episode)
        ended = [key for key, g in self._groups.items() if all(e.ended for e in g.episodes)]
        done = []
        for key in ended:
            group = self._groups.pop(key)
            self.episodes += len(group.episodes)
            self.turns += sum(len(e.calls) for e in group.episodes)
            done.append((key, [e.sample for e in group.episodes]))
        return done

    def abort(self, keys: Sequence[str]) -> None:
        for key in keys:
            if key in self._groups:
                self._close_group(self._groups.pop(key))

    def generate(self, prompts: Sequence[Prompt], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        """n episodes per prompt, all at once (nothing else may be in flight)."""
        return generate_all(self, prompts, n, greedy=greedy)

    # -- the endpoint's side (the agents' loop) ------------------------------------------------
    def calls(self, episode: str) -> Sequence[Call]:
        return self._episode(episode).calls

    async def sample(self, episode: str, request: CallRequest) -> Call:
        e = self._episode(episode)
        if e.started >= self.max_turns:
            raise EndpointError(400, f"this episode made its env.max_turns={self.max_turns} calls: "
                                "answer without another, or raise env.max_turns")
        if e.budget <= 0:
            raise EndpointError(400, f"this episode's calls sampled its env.max_tokens={self.max_tokens} "
                                "tokens: answer without another call, or raise env.max_tokens")
        e.started += 1
        budget = min(request.max_tokens or self.max_new_tokens, e.budget)
        e.budget -= budget  # given back below for what it did not sample
        future = self._loop.create_future()
        self._events.put(("call", e, request, future, budget))
        try:
            call = await future
        except BaseException:  # aborted, refused or cancelled: nothing was sampled
            e.budget += budget
            raise
        e.budget += budget - len(call.sample.response_ids)
        e.calls.append(call)
        return call

    def _episode(self, token: str) -> _Episode:
        episode = self._open.get(token)
        if episode is None or episode.ended:
            raise EndpointError(404, f"episode {token} is not open: it ended or its group was set aside",
                                "episode_not_open")
        return episode

    async def _play(self, episode: _Episode, prompt: Prompt):
        import openai

        start = time.perf_counter()
        client = openai.AsyncOpenAI(base_url=self.endpoint.base_url(episode.token), api_key=self.endpoint.key,
                                    max_retries=0, timeout=self.timeout_s)
        try:
            return await asyncio.wait_for(self.agent(client, prompt), self.timeout_s)
        finally:
            self.env_s += time.perf_counter() - start  # only this loop's thread writes it
            await client.close()

    # -- the engine loop's side ------------------------------------------------------------
    def _start_call(self, episode: _Episode, request: CallRequest, future: asyncio.Future, budget: int) -> None:
        group = self._groups.get(episode.group)
        if group is None or episode.ended:
            self._settle(future, EndpointError(404, "the episode ended while its call waited", "episode_not_open"))
            return
        key = f"call-{next(self._keys)}"
        self.engine.submit(key, Prompt(key, request.prompt_ids), 1, max_tokens=budget, stop=request.stop,
                           **({"greedy": True} if group.greedy else {}))
        self._turns[key] = (episode, request, future)
        group.turns.add(key)

    def _settle(self, future: asyncio.Future, outcome) -> None:
        def settle():
            if not future.done():
                (future.set_exception if isinstance(outcome, BaseException) else future.set_result)(outcome)
        self._loop.call_soon_threadsafe(settle)

    def _ended(self, episode: _Episode) -> None:
        """The agent returned (or failed): the episode's sample, or its group's failure."""
        try:
            value = episode.run.result()
        except (TimeoutError, asyncio.TimeoutError):
            return self._fail(episode, "agent_timeout", f"the agent took over env.timeout_s={self.timeout_s} s")
        except concurrent.futures.CancelledError:
            return self._fail(episode, "agent_raised", "the agent was cancelled")
        except Exception as e:  # noqa: BLE001 - the agent's error fails its group only
            return self._fail(episode, "agent_raised", f"the agent raised {type(e).__name__}: {str(e)[:300]}")
        reward, parts = _reward(value)
        if isinstance(reward, str):
            return self._fail(episode, reward, parts)
        if not episode.calls:
            return self._fail(episode, "agent_no_call", "the agent returned without calling the model")
        trajectory, left_out = chain(episode.calls)
        self.rewrites += left_out
        last = episode.calls[-1].sample
        episode.ended = True
        self._open.pop(episode.token, None)
        self._abort_turns(self._groups[episode.group], episode)  # calls it left running
        episode.sample = Sample(
            response_ids=np.asarray(trajectory.ids, dtype=np.int32),
            behavior_logprobs=np.asarray(trajectory.logprobs, dtype=np.float32),
            finished=last.finished, version_spans=tuple(trajectory.versions), text=last.text,
            observation_spans=tuple(trajectory.observations), reward=reward, reward_parts=parts,
            prompt_ids=np.asarray(trajectory.prompt_ids, dtype=np.int32))

    def _fail(self, episode: _Episode, reason: str, detail: str) -> None:
        """The episode failed, so its group is set aside: end every episode of it now."""
        group = self._groups[episode.group]
        self._close_group(group)
        version = ((self.engine.policy_version, 0),)
        for other in group.episodes:  # what the generator dead-letters: the failure, the texts so far
            other.sample = Sample(np.zeros(0, np.int32), np.zeros(0, np.float32), False, version,
                                  text=other.calls[-1].sample.text if other.calls else "",
                                  failure=(reason, f"episode {episode.index}: {detail}") if other is episode else None)

    def _close_group(self, group: _Group) -> None:
        """End every episode of the group: its calls aborted, its agents cancelled."""
        self._abort_turns(group)
        for episode in group.episodes:
            episode.ended = True
            self._open.pop(episode.token, None)
            if episode.run is not None:
                episode.run.cancel()

    def _abort_turns(self, group: _Group, episode: _Episode | None = None) -> None:
        keys = [k for k in group.turns if episode is None or self._turns[k][0] is episode]
        self.engine.abort(keys)
        for key in keys:
            group.turns.discard(key)
            self._settle(self._turns.pop(key)[2], EndpointError(409, "the episode ended: call aborted",
                                                                 "episode_not_open"))


def _reward(value) -> tuple[float | None | str, dict | str]:
    """(reward, parts) from an agent's return value, or (reason, detail) for a bad one."""
    parts = {}
    if isinstance(value, dict):
        parts = {k: v for k, v in value.items() if k != "reward"}
        if "reward" not in value or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                            for v in parts.values()):
            return "agent_bad_reward", f"the agent returned {value!r:.80}: a dict needs 'reward' and number parts"
        value = value["reward"]
    if value is None:
        return None, {}
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "agent_bad_reward", f"the agent returned {value!r:.80}, not a number, a dict or None"
    if not all(math.isfinite(v) for v in (value, *parts.values())):
        return "agent_reward_nan", f"the agent returned the reward {value} (parts {parts})"
    return float(value), {k: float(v) for k, v in parts.items()}


def agents_of(cfg: Config, engine: GenerationEngine, tokenizer, host: str = LOOPBACK) -> AgentEngine:
    """`engine` playing cfg.env.agent's episodes, its endpoint on `host`."""
    from actors.rewards import load_function

    env = cfg.env
    return AgentEngine(engine, load_function(env.agent, "env.agent"), tokenizer, max_turns=env.max_turns,
                       max_tokens=env.max_tokens, max_new_tokens=cfg.generator.max_new_tokens,
                       temperature=cfg.generator.temperature, timeout_s=env.timeout_s, host=host,
                       tool_parser=env.tool_parser)
