"""The generator loop with the real vLLM CPU engine: staleness admission, version stamps, weight
updates at the safe point (in flight, or between groups), and groups whose rewards raise or
return NaN set aside whole while the loop goes on."""

import dataclasses
import json
import math
import os
import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from actors.generator import Generator, make_generator
from actors.prompts import PromptStream
from actors.rewards import FunctionReward, Scorer
from async_rlhf.config import Config, DataConfig, GeneratorConfig, ModelConfig, RewardSpec
from async_rlhf.launch.stall import StallWatch
from async_rlhf.protocols import QueueStats
from async_rlhf.staleness import StalenessGate
from async_rlhf.types import Sample
from helpers import EngineGate


class ListQueue:
    """An in-memory ExperienceQueue: enough for the loop's logic (the Redis one is tested in buffer/)."""

    def __init__(self):
        self.items, self.dead, self.dropped = [], [], []

    def put(self, groups, timeout_s=None, prompt_position=None):
        self.items.extend(groups)

    def prompt_positions(self):
        return {}

    def samples(self):
        return [t for g in self.items for t in g.members]

    def dead_letter(self, reason, detail, payload=b""):
        self.dead.append((reason, detail, json.loads(payload)))

    def count_dropped(self, reason):
        self.dropped.append(reason)

    def get(self, count, block_ms=1000):
        return []

    def ack(self, entry_ids, reason="trained"):
        pass

    def stats(self):
        return QueueStats(len(self.items), 0, len(self.dead), {})


class ScriptedEngine:
    """A GenerationEngine fake for the loop's own logic: group i of those submitted takes
    lengths[i] steps (default 1), one token a step, stamped with the version of that step."""

    def __init__(self, lengths):
        self.lengths, self.policy_version, self.submitted = dict(enumerate(lengths)), 0, 0
        self.running = {}  # key -> [steps left, n, version spans, tokens]

    @property
    def num_sequences(self):
        return sum(g[1] for g in self.running.values())

    def submit(self, key, prompt, n):
        self.running[key] = [self.lengths.get(self.submitted, 1), n, [], 0]
        self.submitted += 1

    def step(self):
        time.sleep(0.001)
        for g in self.running.values():
            if not g[2] or g[2][-1][0] != self.policy_version:
                g[2].append((self.policy_version, g[3]))
            g[0], g[3] = g[0] - 1, g[3] + 1
        done = [k for k, g in self.running.items() if g[0] == 0]
        return [(k, self._samples(self.running.pop(k))) for k in done]

    def _samples(self, group):
        _, n, spans, tokens = group
        sample = Sample(np.full(tokens, 5, np.int32), np.full(tokens, -1.0, np.float32), False,
                        tuple(spans), "x")
        return [sample] * n

    def abort(self, keys):
        for k in keys:
            self.running.pop(k, None)

    def update_weights(self, named_tensors, version):
        self.policy_version = version


def test_new_groups_never_overtake_old_ones_in_the_stream(tiny_actor_model):
    """A long group admitted with version 0 is still generating when version 1 arrives: the
    short groups admitted after it finish first but go in the stream after it (the gate's bound
    assumes that order), and its own tokens record both versions."""
    engine = ScriptedEngine([300])  # the first group takes 300 steps, every other one 1
    queue, gate = ListQueue(), StalenessGate(max_staleness=10**6, batch_size=4)
    gen = _generator(engine, tiny_actor_model, queue, gate, reward="one_nan_reward")
    stop = threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop,))
    runner.start()
    deadline = time.time() + 30
    while gen.stats().groups < 3 and time.time() < deadline:  # version 0's short groups
        time.sleep(0.001)
    gen.apply_weights(lambda: engine.update_weights([], version=1))
    while len({g.policy_version for g in queue.items}) < 2 and time.time() < deadline:
        time.sleep(0.001)
    stop.set()
    runner.join(30)
    versions = [g.policy_version for g in queue.items]
    assert versions == sorted(versions) and versions[-1] == 1
    (long,) = [g for g in queue.items if len(g.members[0].response_ids) == 300]
    assert [t.version_spans for t in long.members] == [((0, 0), (1, long.members[0].version_spans[1][1]))] * 2
    assert gen.stats().inflight_updates == 1 and gate.running == 0


class NumberedEngine(ScriptedEngine):
    """ScriptedEngine whose samples' texts are '<tokens>:<index in the group>'."""

    def _samples(self, group):
        return [dataclasses.replace(s, text=f"{len(s.response_ids)}:{i}")
                for i, s in enumerate(super()._samples(group))]


def long_ones_uniform(prompts, responses):
    """0.5 for every sample of a response longer than 100 tokens; else its index in the group."""
    return [0.5 if int(r.split(":")[0]) > 100 else float(r.split(":")[1]) for r in responses]


@pytest.mark.parametrize("drop", [True, False])
def test_a_group_of_equal_rewards_is_dropped_unput_and_lets_the_next_go(tiny_actor_model, drop):
    """generator.drop_uniform_groups: the long group (version 0, rewards all 0.5) finishes after
    a short one of version 1 (rewards 0, 1) that waits for it in order. Dropped, it is counted
    (in the stream's counters too), never dead-lettered, gives its slots back with 0 accepted,
    and lets the waiting group go at once. Without the option it is put like any other."""
    engine = NumberedEngine([300, 1, 10**6])  # the third group never ends: nothing else is scored
    queue, gate = ListQueue(), StalenessGate(max_staleness=0, batch_size=2)  # a group per version
    gen = _generator(engine, tiny_actor_model, queue, gate, reward="long_ones_uniform",
                     drop_uniform_groups=drop)
    stop = threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop,))
    runner.start()
    try:
        deadline = time.time() + 30
        while engine.submitted < 1 and time.time() < deadline:
            time.sleep(0.001)
        gen.apply_weights(lambda: engine.update_weights([], version=1))  # admits the short group
        want = 1 if drop else 2
        while len(queue.items) < want and time.time() < deadline:  # before the run ends
            time.sleep(0.001)
        stats = gen.stats()
        assert [[t.reward for t in g.members] for g in queue.items] == [[0.5, 0.5]] * (not drop) + [[0.0, 1.0]]
        assert stats.dropped_uniform == len(queue.dropped) == int(drop)
        assert stats.produced == 2 * want and not queue.dead and stats.set_aside_total == 0
        assert gate.accepted == 2 * want  # the dropped group's 2 slots went back, not accepted
    finally:
        stop.set()
        runner.join(30)
    assert gate.running == 0


class HangingEngine(ScriptedEngine):
    """Its third step never returns (until released): a hung engine loop."""

    def __init__(self):
        super().__init__([10**6])
        self.release, self.calls = threading.Event(), 0

    def step(self):
        self.calls += 1
        if self.calls == 3:
            self.release.wait()
        return super().step()


def test_a_generator_whose_engine_hangs_reports_frozen_steps_with_sequences(tiny_actor_model):
    """The stats a launcher reads (from another thread) while the engine loop hangs: the step
    count stays, the engine holds sequences, and the watchdog calls it stalled."""
    engine = HangingEngine()
    gen = _generator(engine, tiny_actor_model, ListQueue(), StalenessGate(max_staleness=10**6, batch_size=8))
    stop = threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop,))
    runner.start()
    try:
        while engine.calls < 3:
            time.sleep(0.01)
        watch, first = StallWatch(stall_s=60), gen.stats()
        assert first.steps == 2 and first.sequences > 0 and first.updates_waiting == 0
        assert watch.stalled(first.generator_id, first.steps, first.sequences, 0, now=0) == ""
        later = gen.stats()
        assert watch.stalled(later.generator_id, later.steps, later.sequences, 0, now=61).startswith("stalled")
    finally:
        stop.set()
        engine.release.set()
        runner.join(30)


def test_a_generator_whose_weight_load_hangs_reports_an_update_waiting(tiny_actor_model):
    """An idle generator (its gate admits nothing) whose weight load never returns: no
    sequences, but an update waiting, and no progress: the watchdog calls it stalled."""
    engine = ScriptedEngine([1])
    gen = _generator(engine, tiny_actor_model, ListQueue(), StalenessGate(max_staleness=0, batch_size=2))
    stop, hung = threading.Event(), threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop,))
    runner.start()
    loader = threading.Thread(target=gen.apply_weights, args=(hung.wait,))
    try:
        while not engine.submitted or gen.stats().sequences:  # its one admitted group done: idle
            time.sleep(0.01)
        loader.start()
        while not gen.stats().updates_waiting:
            time.sleep(0.01)
        stats, watch = gen.stats(), StallWatch(stall_s=60)
        assert stats.sequences == 0 and stats.updates_waiting == 1
        progress = stats.steps + stats.weight_updates
        assert watch.stalled(stats.generator_id, progress, 0, stats.updates_waiting, now=0) == ""
        assert watch.stalled(stats.generator_id, progress, 0, stats.updates_waiting, now=61).startswith("stalled")
    finally:
        hung.set()
        stop.set()
        loader.join(30)
        runner.join(30)


def picky_reward(prompts, responses):
    """The batch raises if any answer is 'boom'; NaN for answer 'nan'; 0.5 otherwise."""
    if any(p.answer == "boom" for p in prompts):
        raise RuntimeError("reward crashed on boom")
    return [math.nan if p.answer == "nan" else 0.5 for p in prompts]


def one_nan_reward(prompts, responses):
    """NaN for the first sample of each prompt whose answer is 'one' (one member of its group
    fails, the others score), 0.5 for every other sample."""
    seen, out = set(), []
    for p in prompts:
        out.append(math.nan if p.answer == "one" and p.prompt_id not in seen else 0.5)
        seen.add(p.prompt_id)
    return out


def uniform_if_asked(prompts, responses):
    """0.5 for every sample of a prompt whose answer is 'same'; else the response's length."""
    return [0.5 if p.answer == "same" else float(len(r)) + 0.1 * i for i, (p, r) in enumerate(zip(prompts, responses))]


RECORDS = [("copy 1=", "boom"), ("copy 2=", "nan"), ("copy 3=", "3"), ("copy 4=", "4")]


@pytest.fixture(scope="module")
def vllm_engine(tiny_actor_model):
    from actors.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_actor_model, max_new_tokens=8, temperature=1.0, seed=0)
    yield engine
    engine.close()


def _generator(engine, path, queue, gate, records=RECORDS, reward="picky_reward", group_size=2,
               deadline_s=5.0, reward_concurrency=1, **kwargs):
    tok = AutoTokenizer.from_pretrained(path)
    target = reward if ":" in reward else f"{__name__}:{reward}"
    scorer = Scorer([(FunctionReward(target, name="picky"), 1.0, deadline_s)],
                    reward_concurrency)
    gate = EngineGate(gate, lambda: engine.policy_version)
    return Generator(engine, PromptStream(records, tok, seed=0), scorer, queue, gate, generator_id="gen-t",
                     group_size=group_size, max_inflight=4 * group_size, poll_s=0.01, **kwargs)


@pytest.mark.slow
def test_failed_rewards_are_set_aside_and_loop_goes_on(vllm_engine, tiny_actor_model):
    queue, gate = ListQueue(), StalenessGate(max_staleness=1, batch_size=8)
    gen = _generator(vllm_engine, tiny_actor_model, queue, gate)
    stats = gen.run(threading.Event(), max_groups=8)  # capacity (1 + 0 + 1) x 8 = 8 groups of 2
    assert stats.produced == 8 == len(queue.samples())
    assert stats.groups == 4 == len(queue.items)
    assert stats.set_aside == {"reward_raised": 2, "reward_nan": 2}  # groups, once each
    assert sorted(r for r, _, _ in queue.dead) == ["reward_nan"] * 2 + ["reward_raised"] * 2
    reason, detail, payload = next(d for d in queue.dead if d[0] == "reward_raised")
    assert "reward crashed on boom" in detail
    assert payload["prompt"] == "copy 1=" and payload["policy_version"] == 0
    assert len(payload["responses"]) == 2
    assert gate.accepted == 8 and gate.running == 0  # set-aside groups freed their slots
    for group in queue.items:
        group.validate()
        assert group.size == 2 and len({t.group_id for t in group.members}) == 1
    for t in queue.samples():
        assert t.reward == 0.5 and t.reward_parts == {"picky": 0.5} and t.generator_id == "gen-t"
        assert t.policy_version == 0 and t.version_spans == ((0, 0),) and t.generation_s > 0
    assert len({g.group_id for g in queue.items}) == 4
    assert stats.tokens == sum(len(t.response_ids) for t in queue.samples()) and stats.tokens_per_s > 0


@pytest.mark.slow
def test_groups_with_equal_rewards_are_dropped_counted_and_their_slots_freed(vllm_engine, tiny_actor_model):
    """generator.drop_uniform_groups: a group whose rewards are all equal never reaches the
    stream and is counted, not dead-lettered; its gate slots free, so the generator admits
    others in its place (the gate below holds one batch of 8 groups at a time)."""
    queue, gate = ListQueue(), StalenessGate(max_staleness=0, batch_size=16)
    records = [("copy 1=", "same"), ("copy 2=", "2"), ("copy 3=", "same"), ("copy 4=", "4")]
    gen = _generator(vllm_engine, tiny_actor_model, queue, gate, records=records, reward="uniform_if_asked",
                     drop_uniform_groups=True)
    stats = gen.run(threading.Event(), max_groups=12)
    assert stats.dropped_uniform == 6 == len(queue.dropped) and set(queue.dropped) == {"uniform"}
    assert stats.groups == 6 == len(queue.items) and not queue.dead and stats.set_aside == {}
    assert all(len({t.reward for t in g.members}) > 1 for g in queue.items)
    assert (gate.accepted, gate.running) == (12, 0)  # of 24 samples admitted, the dropped 12 freed their slots


@pytest.mark.slow
def test_gate_wait_and_weights_at_the_safe_point(vllm_engine, tiny_actor_model):
    queue = ListQueue()
    gate = StalenessGate(max_staleness=0, batch_size=8)  # synchronous: one batch per weights version
    gen = _generator(vllm_engine, tiny_actor_model, queue, gate, records=[("copy 3=", "3")])
    stop = threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop, 12))
    runner.start()
    deadline = time.time() + 60
    while gen.stats().groups < 4 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert gen.stats().groups == 4 and gen.stats().idle_s > 0.1  # refused: waits for the learner
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(tiny_actor_model).state_dict()
    gen.apply_weights(lambda: vllm_engine.update_weights(weights.items(), 1))  # the gate admits version 1 weights again
    while gen.stats().groups < 8 and time.time() < deadline:
        time.sleep(0.01)
    gen.apply_weights(lambda: vllm_engine.update_weights(weights.items(), 2))
    runner.join(60)
    assert not runner.is_alive()
    assert [t.policy_version for t in queue.samples()] == [0] * 8 + [1] * 8 + [2] * 8
    s = gen.stats()
    assert s.weight_updates == 2 and s.policy_version == 2
    assert s.inflight_updates == 0  # both came while the engine was empty, waiting for them
    assert s.weight_update_s > 0 and s.weight_wait_s >= 0


@pytest.mark.slow
def test_stop_while_waiting_for_admission(vllm_engine, tiny_actor_model):
    gate = StalenessGate(max_staleness=0, batch_size=8, accepted=10**6)  # no slot for any version
    gen = _generator(vllm_engine, tiny_actor_model, ListQueue(), gate)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert gen.run(stop).groups == 0 and gate.running == 0


@pytest.mark.slow
def test_a_hung_reward_is_killed_and_holds_back_only_its_group(vllm_engine, tiny_actor_model):
    """The first of 10 groups (20 samples) hangs its reward for good: it is set aside as
    reward_timeout at its deadline, the 9 others are scored by the second worker meanwhile and
    go in the stream whole, and the run ends with as many threads as it started with."""
    tok = AutoTokenizer.from_pretrained(tiny_actor_model)
    records = [(f"copy {i}=", str(i)) for i in range(10)]
    first = int(next(PromptStream(records, tok, seed=0)).prompt_id.split(":")[1])
    records[first] = (records[first][0], "hang")
    events = []
    queue = ListQueue()
    queue.put = lambda groups, **_: (queue.items.extend(groups), events.append("put"))
    dead_letter = queue.dead_letter
    queue.dead_letter = lambda *args: (dead_letter(*args), events.append("set_aside"))
    warm = _generator(vllm_engine, tiny_actor_model, ListQueue(),
                      StalenessGate(max_staleness=10**6, batch_size=8), reward="helpers:hang_reward",
                      reward_concurrency=2)
    warm.run(threading.Event(), max_groups=1)  # threads the engine starts once are running now
    threads, os_threads = threading.active_count(), len(os.listdir("/proc/self/task"))
    gate = StalenessGate(max_staleness=10**6, batch_size=8)
    gen = _generator(vllm_engine, tiny_actor_model, queue, gate, records=records,
                     reward="helpers:hang_reward", deadline_s=10.0, reward_concurrency=2)
    stats = gen.run(threading.Event(), max_groups=10)
    assert stats.set_aside == {"reward_timeout": 1} and stats.groups == 9 and stats.produced == 18
    assert events == ["put"] * 9 + ["set_aside"]  # the others were not held back by the hung one
    (reason, _, payload), = queue.dead
    assert reason == "reward_timeout" and payload["prompt"] == records[first][0]
    assert all(g.size == 2 and len({t.group_id for t in g.members}) == 1 for g in queue.items)
    assert gate.accepted == 18 and gate.running == 0
    assert gen.scorer.pool.killed == 1
    assert (threading.active_count(), len(os.listdir("/proc/self/task"))) == (threads, os_threads)


def test_make_generator_from_config(tiny_actor_model):
    cfg = Config(
        model=ModelConfig(path=str(tiny_actor_model)),
        data=DataConfig(task="count"),
        generator=GeneratorConfig(engine="hf", max_inflight=4, group_size=2, max_new_tokens=4),
        rewards=(RewardSpec(target="actors.tasks:score"),),
    )
    queue, gate = ListQueue(), StalenessGate(max_staleness=2, batch_size=4)
    gen = make_generator(cfg, queue, EngineGate(gate, lambda: 0), index=1)
    assert gen.generator_id == "gen-1" and gen.run(threading.Event(), max_groups=2).produced == 4
    assert [g.size for g in queue.items] == [2, 2]
    assert all(t.version_spans == ((0, 0),) for t in queue.samples())
    assert all(t.reward_parts.keys() == {"actors.tasks:score"} for t in queue.samples())
    assert all(np.isfinite(t.behavior_logprobs).all() for t in queue.samples())
    assert torch.get_num_threads() >= 1
    # prompts that cannot fit the model's context with max_new_tokens: an error naming the fix
    too_long = dataclasses.replace(cfg, generator=dataclasses.replace(cfg.generator, max_new_tokens=250))
    with pytest.raises(ValueError, match="longer than 6 tokens .* lower generator.max_new_tokens"):
        make_generator(too_long, queue, EngineGate(gate, lambda: 0))


def _redis_queue(redis_server, stream_name, consumer):
    import redis

    from buffer.redis_stream import RedisExperienceQueue

    client = redis.Redis.from_url(redis_server.url, decode_responses=False)
    return RedisExperienceQueue(client, consumer, stream=stream_name)


@pytest.mark.slow
def test_generator_into_the_real_redis_stream(vllm_engine, tiny_actor_model, redis_server, stream_name):
    """End to end on the producer side: what the generator puts, a learner consumer reads back
    intact, one entry per group; the failed-reward groups are in the dead-letter stream,
    counted by reason."""
    producer = _redis_queue(redis_server, stream_name, "gen-t")
    consumer = _redis_queue(redis_server, stream_name, "learner-0")
    gate = StalenessGate(max_staleness=0, batch_size=8)
    gen = _generator(vllm_engine, tiny_actor_model, producer, gate)
    assert gen.run(threading.Event(), max_groups=4).produced == 4  # 4 prompts x 2 samples, the
    # boom and nan prompts' groups set aside
    got = consumer.get(10, block_ms=2000)
    assert [r.group.size for r in got] == [2, 2]
    for r in got:
        r.group.validate()
        assert r.group.policy_version == vllm_engine.policy_version
        for t in r.group.members:
            assert t.generator_id == "gen-t" and t.reward == 0.5
    consumer.ack([r.entry_id for r in got])
    counters = producer.stats().counters
    assert counters["produced"] == 2 and counters["trained"] == 2  # groups
    assert counters["set_aside:reward_raised"] == 1 and counters["set_aside:reward_nan"] == 1
    letters = producer.dead_letters()
    assert sorted(d.reason for d in letters) == ["reward_nan", "reward_raised"]
    assert json.loads(letters[0].raw)["generator_id"] == "gen-t"
    # a generator that restarts under the same id continues its prompts where its groups end
    assert producer.prompt_positions() == {"gen-t": 4}
    again = _generator(vllm_engine, tiny_actor_model, producer, gate)
    assert again.stats().prompt_start == 4 == again.prompts.position
    fresh_start = PromptStream(RECORDS, AutoTokenizer.from_pretrained(tiny_actor_model), seed=0)
    fresh_start.take(4)
    assert next(again.prompts).prompt_id == next(fresh_start).prompt_id


@pytest.mark.slow
def test_a_group_reaches_the_stream_whole_or_not_at_all(
    vllm_engine, tiny_actor_model, redis_server, stream_name
):
    """One sample of one group fails its reward: that group is set aside whole and counted
    once; the stream holds only whole groups, one entry each."""
    producer = _redis_queue(redis_server, stream_name, "gen-t")
    consumer = _redis_queue(redis_server, stream_name, "learner-0")
    records = [("copy 1=", "one"), ("copy 2=", "2"), ("copy 3=", "3"), ("copy 4=", "4")]
    gate = StalenessGate(max_staleness=0, batch_size=12)
    gen = _generator(vllm_engine, tiny_actor_model, producer, gate, records=records,
                     reward="one_nan_reward", group_size=3)
    # 4 prompts x 3 samples; the "one" prompt's group set aside whole
    assert gen.run(threading.Event(), max_groups=4).produced == 9
    got = consumer.get(20, block_ms=2000)
    assert [r.group.size for r in got] == [3, 3, 3]
    for r in got:
        r.group.validate()
        assert len({t.group_id for t in r.group.members}) == 1
        assert len({t.prompt_ids.tobytes() for t in r.group.members}) == 1
        assert all(t.reward == 0.5 for t in r.group.members)
    counters = producer.stats().counters
    assert counters["produced"] == 3 and counters["set_aside"] == 1
    assert counters["set_aside:reward_nan"] == 1
    [letter] = producer.dead_letters()
    assert letter.reason == "reward_nan" and letter.original_id == ""
    payload = json.loads(letter.raw)
    assert payload["prompt"] == "copy 1=" and len(payload["responses"]) == 3
    stats = gen.stats()
    assert stats.set_aside == {"reward_nan": 1} and stats.groups == 3 and stats.produced == 9
    assert gate.accepted == 9 and gate.running == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inflight", "between_groups"])
def test_weight_update_in_flight_or_between_groups(
    vllm_engine, tiny_actor_model, redis_server, stream_name, mode
):
    """An update that arrives while the engine is full: in flight, the sequences go on with
    the new weights and their tokens' versions reach the learner through the codec; between
    groups, it waits for the engine to empty and every sample has one version."""
    from transformers import AutoModelForCausalLM

    producer = _redis_queue(redis_server, stream_name, "gen-t")
    consumer = _redis_queue(redis_server, stream_name, "learner-0")
    gate = StalenessGate(max_staleness=10**6, batch_size=8)  # always admits: the engine stays full
    gen = _generator(vllm_engine, tiny_actor_model, producer, gate, records=[("copy 1234=", "1")],
                     weight_updates=mode)
    weights = AutoModelForCausalLM.from_pretrained(tiny_actor_model).state_dict()
    old = vllm_engine.policy_version  # the module's engine: what earlier tests left
    stop = threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop,))
    runner.start()
    try:
        deadline = time.time() + 60
        while gen.stats().groups < 4 and time.time() < deadline:
            time.sleep(0.01)
        gen.apply_weights(lambda: vllm_engine.update_weights(weights.items(), old + 1))
        while gen.stats().groups < 16 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        runner.join(60)
        vllm_engine.update_weights(weights.items(), version=old)
    stats = gen.stats()
    assert stats.weight_updates == 1 and stats.groups >= 16 and gate.running == 0
    assert stats.mean_inflight > 2 and stats.tokens_per_s > 0
    groups = [r.group for r in consumer.get(10**4, block_ms=2000)]  # decoded, in stream order
    members = [t for g in groups for t in g.members]
    # a new group never overtakes an old one in the stream (the gate's bound assumes it)
    assert [g.policy_version for g in groups] == sorted(g.policy_version for g in groups)
    assert len(members) == stats.produced == gate.accepted
    spans = [t.version_spans for t in members]
    assert {sp[0][0] for sp in spans} == {old, old + 1}
    assert all(t.policy_version == t.version_spans[0][0] for t in members)
    crossed = [t for t in members if len(t.version_spans) == 2]
    if mode == "inflight":
        assert stats.inflight_updates == 1 and crossed
        for t in crossed:  # started with the old version, went on with the new: staleness is the old's
            (v0, start0), (v1, start1) = t.version_spans
            assert (v0, start0, v1) == (old, 0, old + 1) and 0 < start1 < len(t.response_ids)
            assert t.policy_version == old and t.token_versions().tolist() == (
                [old] * start1 + [old + 1] * (len(t.response_ids) - start1))
    else:
        assert stats.inflight_updates == 0 and not crossed
        assert stats.weight_wait_s > 0  # for the engine to empty
