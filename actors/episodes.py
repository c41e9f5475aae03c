"""Multi-turn episodes on the same engine: an environment answers each turn, and a group is
`group_size` episodes of one prompt.

`EpisodeEngine` wraps a GenerationEngine and is one itself, so the generator's loop, its
staleness gate, its whole-group puts and its weight updates are the same for completions and
episodes. `submit(key, prompt, n)` starts n episodes; each builds its environment (env.target,
`module:Class`, with env.args) and calls `reset(prompt)`; whatever text that returns is the
first observation. Then, until the environment says done:

    model turn:   the context (prompt + every token so far) goes to the engine as one request,
                  continuously batched with every other episode's turns and the completions;
    environment:  `step(turn text)` -> (observation, done, reward or None); the observation's
                  tokens are appended to the context, and the next turn is submitted.

`step()` returns a group once all its episodes have ended. Its samples hold every turn's and
observation's tokens: the observations' are named by `observation_spans` (loss mask 0,
behaviour log-prob 0), the turns' log-probs are the engine's, and `version_spans` names the
weights that sampled each token across turns (an in-flight update between or within turns),
so staleness is the first token's, as for a completion. An episode's reward is the last step's
reward; where that is None, the configured rewards score the transcript (the generator's
scorer, on `Sample.text`).

Limits: env.max_turns model turns, and env.max_tokens response tokens in all (a turn may take
at most generator.max_new_tokens of them). An episode that reaches either without `done` ends
there, `finished` False, as a completion cut at its token limit.

Environment calls run on an asyncio loop in a thread of their own, never on the engine loop: an
environment's methods may be `async def` (awaited there) or plain (run in a thread pool of
env.concurrency threads), so a slow or remote environment delays its own episode only. A call
that raises, or takes over env.timeout_s, fails its episode: the group comes back at once with
the failure on that sample (reason env_raised, env_timeout or env_bad_output), the generator
sets it aside and counts it, and the group's other turns are aborted. A plain method that hangs
keeps its pool thread: write environments that wait (tools, remote calls) as `async def`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue

import numpy as np

from async_rlhf.config import Config
from async_rlhf.protocols import GenerationEngine
from async_rlhf.types import Prompt, Sample

from actors.engines import generate_all
from actors.rewards import load_function


@dataclass
class _Episode:
    group: str
    index: int
    version: int  # the engine's version when its group was submitted
    env: object = None
    ids: list[int] = field(default_factory=list)  # response tokens: turns and observations
    logprobs: list[float] = field(default_factory=list)
    observations: list[tuple[int, int]] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)
    turns: int = 0
    ended: bool = False
    done: bool = False  # the environment ended it (else a limit did)
    reward: float | None = None
    failure: tuple[str, str] | None = None


@dataclass
class _Group:
    prompt: Prompt
    episodes: list[_Episode]
    greedy: bool = False  # argmax turns (evaluation)
    turns: set[str] = field(default_factory=set)  # its requests in the engine


class EpisodeEngine:
    """A GenerationEngine whose groups are episodes with an environment (see the module doc).
    Everything else (weights, versions, the weight-sync group) is the wrapped engine's."""

    def __init__(self, engine: GenerationEngine, make_env: Callable[[], object], tokenizer, *,
                 max_turns: int, max_tokens: int, max_new_tokens: int, timeout_s: float,
                 concurrency: int = 64, poll_s: float = 0.05):
        self.engine, self.make_env, self.tokenizer = engine, make_env, tokenizer
        self.max_turns, self.max_tokens, self.max_new_tokens = max_turns, max_tokens, max_new_tokens
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._groups: dict[str, _Group] = {}
        self._turns: dict[str, _Episode] = {}  # engine request key -> its episode
        self._replies: SimpleQueue[tuple[_Episode, str, concurrent.futures.Future]] = SimpleQueue()
        self.episodes = self.turns = 0  # of the episodes returned (step)
        self.env_s = 0.0  # seconds spent in environment calls, summed over episodes
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(concurrency, "env"))
        threading.Thread(target=self._loop.run_forever, name="env-loop", daemon=True).start()

    def __getattr__(self, name: str):
        if name == "engine":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)  # weights, versions, sync_ranks, close ...

    @property
    def num_sequences(self) -> int:
        """Turns in the engine (an episode waiting for its environment holds no engine slot;
        the staleness gate bounds how many are open)."""
        return self.engine.num_sequences

    def submit(self, key: str, prompt: Prompt, n: int, *, greedy: bool = False) -> None:
        version = self.engine.policy_version
        group = self._groups[key] = _Group(prompt, [_Episode(key, i, version) for i in range(n)], greedy)
        for episode in group.episodes:
            self._call(episode, "reset", prompt)

    def step(self) -> list[tuple[str, list[Sample]]]:
        """One engine step (or, with no turn in the engine, a wait of up to poll_s for an
        environment), then every environment reply that came meanwhile; the groups that ended."""
        if self.engine.num_sequences:
            for key, (sample,) in self.engine.step():
                self._turn_ended(self._turns.pop(key), sample)
            replies = []
        else:
            try:
                replies = [self._replies.get(timeout=self.poll_s)]
            except Empty:
                replies = []
        while not self._replies.empty():
            replies.append(self._replies.get())
        for episode, method, future in replies:
            if episode.group in self._groups and not episode.ended:
                self._replied(episode, method, future)
        ended = [self._groups.pop(key) for key, g in list(self._groups.items()) if all(e.ended for e in g.episodes)]
        self.episodes += sum(len(g.episodes) for g in ended)
        self.turns += sum(e.turns for g in ended for e in g.episodes)
        return [(g.episodes[0].group, [self._sample(e) for e in g.episodes]) for g in ended]

    def abort(self, keys: Sequence[str]) -> None:
        turns = [turn for key in keys if key in self._groups for turn in self._groups.pop(key).turns]
        for turn in turns:
            del self._turns[turn]
        self.engine.abort(turns)

    def generate(self, prompts: Sequence[Prompt], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        """n episodes per prompt, all at once (nothing else may be in flight)."""
        return generate_all(self, prompts, n, greedy=greedy)

    # -- turns ------------------------------------------------------------------------------
    def _call(self, episode: _Episode, method: str, arg) -> None:
        """Run the episode's environment's `method(arg)` on the environment loop (reset builds
        the environment first); its outcome is queued for `step`."""

        async def call():
            start = time.perf_counter()
            try:
                if method == "reset":
                    episode.env = await asyncio.to_thread(self.make_env)
                fn = getattr(episode.env, method)
                pending = fn(arg) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, arg)
                return await asyncio.wait_for(pending, self.timeout_s)
            finally:
                self.env_s += time.perf_counter() - start  # only this loop's thread writes it

        future = asyncio.run_coroutine_threadsafe(call(), self._loop)
        future.add_done_callback(lambda f: self._replies.put((episode, method, f)))

    def _submit_turn(self, episode: _Episode) -> None:
        group = self._groups[episode.group]
        key = f"{episode.group}#{episode.index}.{episode.turns}"
        context = dataclasses.replace(group.prompt, token_ids=(*group.prompt.token_ids, *episode.ids))
        budget = min(self.max_new_tokens, self.max_tokens - len(episode.ids))
        self.engine.submit(key, context, 1, max_tokens=budget, **({"greedy": True} if group.greedy else {}))
        self._turns[key] = episode
        group.turns.add(key)

    def _turn_ended(self, episode: _Episode, sample: Sample) -> None:
        self._groups[episode.group].turns.discard(f"{episode.group}#{episode.index}.{episode.turns}")
        start = len(episode.ids)
        for version, offset in sample.version_spans:
            if not episode.versions:
                episode.versions.append((version, 0))  # an opening observation is the first turn's
            elif version != episode.versions[-1][0]:
                episode.versions.append((version, start + offset))
        episode.ids.extend(sample.response_ids.tolist())
        episode.logprobs.extend(sample.behavior_logprobs.tolist())
        episode.turns += 1
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        self._call(episode, "step", text)

    def _replied(self, episode: _Episode, method: str, future: concurrent.futures.Future) -> None:
        try:
            reply = future.result()
        except (TimeoutError, asyncio.TimeoutError):
            return self._fail(episode, "env_timeout", f"{method} took over env.timeout_s={self.timeout_s} s")
        except Exception as e:  # noqa: BLE001 - the environment's error fails its episode only
            return self._fail(episode, "env_raised", f"{method} raised {type(e).__name__}: {e}")
        if method == "reset":
            if not isinstance(reply, str):
                return self._fail(episode, "env_bad_output", f"reset returned {reply!r:.60}, not a str")
            return self._observe(episode, reply)
        if not (isinstance(reply, tuple) and len(reply) == 3 and isinstance(reply[0], str)
                and (reply[2] is None or isinstance(reply[2], (int, float)))):
            return self._fail(episode, "env_bad_output", f"step returned {reply!r:.60}, not "
                              "(observation str, done bool, reward float or None)")
        observation, done, reward = reply
        episode.reward = None if reward is None else float(reward)
        if episode.reward is not None and not math.isfinite(episode.reward):
            return self._fail(episode, "env_reward_nan", f"step returned the reward {reward}")
        if done or episode.turns >= self.max_turns:
            episode.ended, episode.done = True, bool(done)
        else:
            self._observe(episode, observation)

    def _observe(self, episode: _Episode, text: str) -> None:
        """Append an observation and submit the next turn, or end the episode at its budget."""
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        if len(episode.ids) + len(ids) >= self.max_tokens:
            episode.ended = True  # no token left for a turn after it
            return
        if ids:
            episode.observations.append((len(episode.ids), len(episode.ids) + len(ids)))
            episode.ids.extend(ids)
            episode.logprobs.extend([0.0] * len(ids))
        self._submit_turn(episode)

    def _fail(self, episode: _Episode, reason: str, detail: str) -> None:
        """The episode failed, so its group is set aside: end every episode of it now."""
        episode.failure = (reason, f"episode {episode.index}: {detail}")
        group = self._groups[episode.group]
        self.engine.abort(list(group.turns))
        for turn in group.turns:
            del self._turns[turn]
        group.turns.clear()
        for other in group.episodes:
            other.ended = True

    def _sample(self, episode: _Episode) -> Sample:
        ids = np.asarray(episode.ids, dtype=np.int32)
        return Sample(
            response_ids=ids,
            behavior_logprobs=np.asarray(episode.logprobs, dtype=np.float32),
            finished=episode.done,
            version_spans=tuple(episode.versions) or ((episode.version, 0),),
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            observation_spans=tuple(episode.observations),
            reward=episode.reward,
            failure=episode.failure,
        )


def episodes_of(cfg: Config, engine: GenerationEngine, tokenizer) -> GenerationEngine:
    """`engine` playing cfg.env's episodes, an environment's or an agent's (actors/agents.py; as
    is without either): the generators' and the evaluator's."""
    env = cfg.env
    if env.agent:
        from actors.agents import agents_of

        return agents_of(cfg, engine, tokenizer)
    if not env.target:
        return engine
    make_env = functools.partial(load_function(env.target, "env.target"), **env.args)
    return EpisodeEngine(engine, make_env, tokenizer, max_turns=env.max_turns, max_tokens=env.max_tokens,
                         max_new_tokens=cfg.generator.max_new_tokens, timeout_s=env.timeout_s,
                         concurrency=env.concurrency)
