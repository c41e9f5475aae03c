"""The generator loop with the real vLLM CPU engine: staleness admission, version stamps, weight
updates at the safe point, and groups whose rewards raise or return NaN set aside whole while
the loop goes on."""

import dataclasses
import json
import math
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
from async_rlhf.protocols import QueueStats
from async_rlhf.staleness import StalenessGate


class ListQueue:
    """An in-memory ExperienceQueue: enough for the loop's logic (the Redis one is tested in buffer/)."""

    def __init__(self):
        self.items, self.dead = [], []

    def put(self, groups, timeout_s=None, prompt_position=None):
        self.items.extend(groups)

    def prompt_positions(self):
        return {}

    def samples(self):
        return [t for g in self.items for t in g.members]

    def dead_letter(self, reason, detail, payload=b""):
        self.dead.append((reason, detail, json.loads(payload)))

    def get(self, count, block_ms=1000):
        return []

    def ack(self, entry_ids, reason="trained"):
        pass

    def stats(self):
        return QueueStats(len(self.items), 0, len(self.dead), {})


class EngineGate:
    """The AdmissionGate protocol over StalenessGate, keyed on the engine's weights version (what
    the launcher's gate does through its coordinator)."""

    def __init__(self, gate, version_fn):
        self.gate, self.version_fn = gate, version_fn

    def try_admit(self, n):
        return self.gate.try_admit(n, self.version_fn())

    def finish(self, n_admitted, n_accepted):
        self.gate.finish(n_admitted, n_accepted)


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


RECORDS = [("copy 1=", "boom"), ("copy 2=", "nan"), ("copy 3=", "3"), ("copy 4=", "4")]


@pytest.fixture(scope="module")
def vllm_engine(tiny_actor_model):
    from actors.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_actor_model, max_new_tokens=8, temperature=1.0, seed=0)
    yield engine
    engine.close()


def _generator(engine, path, queue, gate, records=RECORDS, reward="picky_reward", group_size=2):
    tok = AutoTokenizer.from_pretrained(path)
    scorer = Scorer([(FunctionReward(f"{__name__}:{reward}", name="picky"), 1.0, 5.0)])
    gate = EngineGate(gate, lambda: engine.policy_version)
    return Generator(engine, PromptStream(records, tok, seed=0), scorer, queue, gate,
                     generator_id="gen-t", prompts_per_batch=4, group_size=group_size, poll_s=0.01)


@pytest.mark.slow
def test_failed_rewards_are_set_aside_and_loop_goes_on(vllm_engine, tiny_actor_model):
    queue, gate = ListQueue(), StalenessGate(max_staleness=1, batch_size=8)
    gen = _generator(vllm_engine, tiny_actor_model, queue, gate)
    stats = gen.run(threading.Event(), max_batches=2)  # capacity (1 + 0 + 1) x 8 = 2 batches
    assert stats["batches"] == 2 and stats["produced"] == 8 == len(queue.samples())
    assert stats["groups"] == 4 == len(queue.items)
    assert stats["set_aside"] == {"reward_raised": 2, "reward_nan": 2}  # groups, once each
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
        assert t.policy_version == 0 and t.generation_s > 0
    assert len({g.group_id for g in queue.items}) == 4
    assert stats["tokens"] == sum(len(t.response_ids) for t in queue.samples()) and stats["tokens_per_s"] > 0


@pytest.mark.slow
def test_gate_wait_and_weights_at_the_safe_point(vllm_engine, tiny_actor_model):
    queue = ListQueue()
    gate = StalenessGate(max_staleness=0, batch_size=8)  # synchronous: one batch per weights version
    gen = _generator(vllm_engine, tiny_actor_model, queue, gate, records=[("copy 3=", "3")])
    stop = threading.Event()
    runner = threading.Thread(target=gen.run, args=(stop, 3))
    runner.start()
    deadline = time.time() + 60
    while gen.stats()["batches"] < 1 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert gen.stats()["batches"] == 1 and gen.stats()["idle_s"] > 0.1  # refused: waits for the learner
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(tiny_actor_model).state_dict()
    gen.apply_weights(weights.items(), version=1)  # the gate admits version 1 weights again
    while gen.stats()["batches"] < 2 and time.time() < deadline:
        time.sleep(0.01)
    gen.apply_weights(weights.items(), version=2)
    runner.join(60)
    assert not runner.is_alive()
    assert [t.policy_version for t in queue.samples()] == [0] * 8 + [1] * 8 + [2] * 8
    s = gen.stats()
    assert s["weight_updates"] == 2 and s["policy_version"] == 2
    assert s["weight_update_s"] > 0 and s["weight_wait_s"] >= 0


@pytest.mark.slow
def test_stop_while_waiting_for_admission(vllm_engine, tiny_actor_model):
    gate = StalenessGate(max_staleness=0, batch_size=8, accepted=10**6)  # no slot for any version
    gen = _generator(vllm_engine, tiny_actor_model, ListQueue(), gate)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert gen.run(stop)["batches"] == 0 and gate.running == 0


def test_make_generator_from_config(tiny_actor_model):
    cfg = Config(
        model=ModelConfig(path=str(tiny_actor_model)),
        data=DataConfig(task="count"),
        generator=GeneratorConfig(engine="hf", prompts_per_batch=2, group_size=2, max_new_tokens=4),
        rewards=(RewardSpec(target="actors.tasks:score"),),
    )
    queue, gate = ListQueue(), StalenessGate(max_staleness=2, batch_size=4)
    gen = make_generator(cfg, queue, EngineGate(gate, lambda: 0), index=1)
    assert gen.generator_id == "gen-1" and gen.step() == 4
    assert [g.size for g in queue.items] == [2, 2]
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
    assert gen.step() == 4  # 4 prompts x 2 samples, the boom and nan prompts' groups set aside
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
    assert again.stats()["prompt_start"] == 4 == again.prompts.position
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
    assert gen.step() == 9  # 4 prompts x 3 samples; the "one" prompt's group set aside whole
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
    assert stats["set_aside"] == {"reward_nan": 1} and stats["groups"] == 3 and stats["produced"] == 9
    assert gate.accepted == 9 and gate.running == 0
