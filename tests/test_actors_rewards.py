"""Rewards: function, HTTP (a real local server), reward model (a real tiny HF classifier), their
weighted combination, and failures that are set aside instead of raised."""

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from actors.rewards import FunctionReward, HttpReward, ModelReward, Scorer, load_function, make_reward
from async_rlhf.config import RewardSpec
from async_rlhf.types import Prompt

PROMPTS = [Prompt(f"p{i}", (1,), f"copy {i}{i}=", f"{i}{i}") for i in range(4)]


# Reward functions addressed as tests.test_actors_rewards:<name>, as a config would name them.
def length_reward(prompts, responses):
    return [len(r) / 10 for r in responses]


def picky_reward(prompts, responses):
    """Raises on responses containing 'boom', NaN on 'nan', 1.0 otherwise."""
    if any("boom" in r for r in responses):
        raise RuntimeError("cannot score boom")
    return [math.nan if r == "nan" else 1.0 for r in responses]


def slow_reward(prompts, responses):
    time.sleep(0.5)
    return [1.0] * len(responses)


def short_reward(prompts, responses):
    return [1.0]


def test_load_function_errors():
    assert load_function("actors.tasks:score").__name__ == "score"
    with pytest.raises(ValueError, match="must look like module:function"):
        load_function("actors.tasks.score")
    with pytest.raises(AttributeError, match="has no 'nope'"):
        load_function("actors.tasks:nope")


def test_default_spec_scores_tasks():
    scorer = Scorer.from_specs([RewardSpec(target="actors.tasks:score")])
    got = scorer.score(PROMPTS[:2], ["00", "1"])
    assert [s.reward for s in got] == [1.0, pytest.approx(0.4)]
    assert got[0].parts == {"actors.tasks:score": 1.0} and got[0].ok


def test_weighted_combination_keeps_parts():
    scorer = Scorer([
        (FunctionReward("actors.tasks:score"), 0.5, 5.0),
        (FunctionReward(f"{__name__}:length_reward", name="length"), 2.0, 5.0),
    ])
    (s,) = scorer.score(PROMPTS[:1], ["00"])
    assert s.parts == {"actors.tasks:score": 1.0, "length": pytest.approx(0.2)}
    assert s.reward == pytest.approx(0.5 * 1.0 + 2.0 * 0.2)
    with pytest.raises(ValueError, match="names must be distinct"):
        Scorer([(FunctionReward("actors.tasks:score"), 1.0, 1.0)] * 2)


def test_raise_and_nan_set_aside_per_sample():
    scorer = Scorer([(FunctionReward(f"{__name__}:picky_reward", name="picky"), 1.0, 5.0)])
    got = scorer.score(PROMPTS, ["ok", "boom", "nan", "fine"])
    assert [s.ok for s in got] == [True, False, False, True]  # the batch raised; others survive
    assert got[1].failure[0] == "reward_raised" and "cannot score boom" in got[1].failure[1]
    assert got[2].failure[0] == "reward_nan"
    assert got[0].reward == got[3].reward == 1.0


def test_timeout_and_bad_output():
    slow = Scorer([(FunctionReward(f"{__name__}:slow_reward"), 1.0, 0.05)])
    start = time.perf_counter()
    got = slow.score(PROMPTS[:2], ["a", "b"])
    assert time.perf_counter() - start < 0.4  # did not wait for the slow reward
    assert {s.failure[0] for s in got} == {"reward_timeout"}
    short = Scorer([(FunctionReward(f"{__name__}:short_reward"), 1.0, 1.0)])
    assert {s.failure[0] for s in short.score(PROMPTS[:2], ["a", "b"])} == {"reward_bad_output"}


class _Handler(BaseHTTPRequestHandler):
    calls = 0
    fail_first = 0  # answer 503 to this many requests first

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        if type(self).calls <= type(self).fail_first:
            self.send_response(503)
            self.end_headers()
            return
        if body["responses"] and body["responses"][0] == "sleep":
            time.sleep(1.0)
        rewards = [float(r == a) for r, a in zip(body["responses"], body["answers"])]
        data = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out first (on purpose)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def http_url():
    _Handler.calls, _Handler.fail_first = 0, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_http_reward_with_retries(http_url):
    _Handler.fail_first = 2
    reward = make_reward(RewardSpec(kind="http", target=http_url, retries=2, timeout_s=2.0))
    assert reward(PROMPTS[:2], ["00", "x"]) == [1.0, 0.0]
    assert _Handler.calls == 3  # two 503s, then an answer


def test_http_reward_gives_up_and_times_out(http_url):
    _Handler.fail_first = 10
    scorer = Scorer.from_specs([RewardSpec(kind="http", target=http_url, retries=1, timeout_s=2.0)])
    got = scorer.score(PROMPTS[:1], ["00"])
    assert got[0].failure[0] == "reward_raised" and "503" in got[0].failure[1]
    _Handler.calls, _Handler.fail_first = 0, 0
    slow = HttpReward(http_url, timeout_s=0.2, retries=0)
    with pytest.raises((TimeoutError, OSError)):
        slow(PROMPTS[:1], ["sleep"])


def test_model_reward(tmp_path, tiny_actor_model):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_actor_model).save_pretrained(tmp_path / "rm")
    reward = ModelReward(str(tmp_path / "rm"), batch_size=2)
    one = reward(PROMPTS[:1], ["00"])
    batch = reward(PROMPTS[:3], ["00", "1", "abcdef"])  # padded batches score the same
    assert len(batch) == 3 and batch[0] == pytest.approx(one[0], abs=1e-5)
    assert all(math.isfinite(v) for v in batch)
    spec = RewardSpec(kind="model", target=str(tmp_path / "rm"), weight=0.5)
    (scored,) = Scorer.from_specs([spec]).score(PROMPTS[:1], ["00"])
    assert scored.reward == pytest.approx(0.5 * one[0], abs=1e-5)
