"""Rewards: function, HTTP (a real local server), reward model (a real tiny HF classifier), their
weighted combination, and failures that are set aside instead of raised."""

import json
import math
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from actors.rewards import (FunctionReward, HttpReward, ModelReward, Scorer, deadline_s, load_function,
                            make_reward)
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


def hang_reward(prompts, responses):
    """Hangs for good on a response "hang:DIR", after writing its process id into DIR; 1.0
    otherwise."""
    for r in responses:
        if r.startswith("hang:"):
            (Path(r[5:]) / str(os.getpid())).touch()
            threading.Event().wait()
    return [1.0] * len(responses)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _hung_pids(folder):
    return [int(p.name) for p in folder.iterdir()]


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


def test_timeout_and_bad_output(tmp_path):
    hung = Scorer([(FunctionReward(f"{__name__}:hang_reward"), 1.0, 0.5)])
    threads = threading.active_count()
    got = hung.score(PROMPTS[:2], ["a", f"hang:{tmp_path}"])
    assert {s.failure[0] for s in got} == {"reward_timeout"} and "process was killed" in got[0].failure[1]
    assert hung.pool.killed == 1 and threading.active_count() == threads  # no thread left behind
    assert not any(_alive(pid) for pid in _hung_pids(tmp_path))  # nor the process
    assert [s.ok for s in hung.score(PROMPTS[:1], ["a"])] == [True]  # a new worker took its place
    short = Scorer([(FunctionReward(f"{__name__}:short_reward"), 1.0, 1.0)])
    assert {s.failure[0] for s in short.score(PROMPTS[:2], ["a", "b"])} == {"reward_bad_output"}


def test_a_hung_call_holds_back_only_its_own_group(tmp_path):
    """Two calls at once: the hung one's worker is killed at its deadline, the other answers
    meanwhile from the second worker; the killed process is gone."""
    scorer = Scorer([(FunctionReward(f"{__name__}:hang_reward"), 1.0, 60.0)], concurrency=2)
    scorer.score(PROMPTS[:1], ["warm"])  # one worker up: the next call starts the second
    hung: list = []
    caller = threading.Thread(target=lambda: hung.extend(scorer.score(PROMPTS[:1], [f"hang:{tmp_path}"])))
    caller.start()
    while not _hung_pids(tmp_path):
        time.sleep(0.05)
    (pid,) = _hung_pids(tmp_path)
    assert [s.reward for s in scorer.score(PROMPTS[:2], ["a", "b"])] == [1.0, 1.0]
    assert caller.is_alive()  # answered while the hung call still waited
    os.kill(pid, signal.SIGKILL)  # as if its deadline had come: the pool counts a dead worker
    caller.join()
    assert hung[0].failure[0] == "reward_raised" and "worker process died" in hung[0].failure[1]
    assert scorer.pool.killed == 1 and not _alive(pid)


class GatedReward:
    """1.0 for every response; a pickled copy (a pool worker's) loads only once `gate` exists,
    as a reward model loads while its worker starts."""

    name = "gated"

    def __init__(self, gate: Path):
        self.gate = gate

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        while not self.gate.exists():
            time.sleep(0.02)

    def __call__(self, prompts, responses):
        return [1.0] * len(responses)


def test_spawned_workers_load_the_rewards_while_the_caller_goes_on(tmp_path):
    """A generator spawns its reward workers before its engine starts and waits for them after:
    spawn() returns while they load; start() waits for them."""
    import multiprocessing

    gate = tmp_path / "loaded"
    scorer = Scorer([(GatedReward(gate), 1.0, 5.0)], concurrency=2)

    def workers():
        return {p.pid for p in multiprocessing.active_children() if p.name == "reward-worker"}

    before = workers()
    opener = threading.Timer(2.0, gate.touch)
    opener.start()
    scorer.pool.spawn()
    assert not gate.exists()  # it returned before the workers could load
    assert len(workers() - before) == 2
    scorer.pool.start()
    assert gate.exists()
    assert [s.reward for s in scorer.score(PROMPTS[:2], ["a", "b"])] == [1.0, 1.0]
    scorer.pool.close()
    opener.join()


def test_http_deadline_covers_retries():
    spec = RewardSpec(kind="http", target="http://127.0.0.1:1/score", timeout_s=2.0, retries=2)
    assert deadline_s(spec) == pytest.approx(3 * 2.0 + 0.1 + 0.2)
    assert deadline_s(RewardSpec(target="actors.tasks:score", timeout_s=3.0, retries=2)) == 3.0


class _Handler(BaseHTTPRequestHandler):
    calls = 0
    fail_first = 0  # answer 503 to this many requests first
    sleep_first = 0  # answer this many requests (after those) 1 s late

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        if type(self).calls <= type(self).fail_first:
            self.send_response(503)
            self.end_headers()
            return
        late = type(self).calls <= type(self).fail_first + type(self).sleep_first
        if late or (body["responses"] and body["responses"][0] == "sleep"):
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
    _Handler.calls, _Handler.fail_first, _Handler.sleep_first = 0, 0, 0
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


def test_http_retries_after_a_timeout(http_url):
    """The first attempt times out, the retry answers: the scorer's deadline covers both."""
    _Handler.sleep_first = 1
    scorer = Scorer.from_specs([RewardSpec(kind="http", target=http_url, retries=1, timeout_s=0.5)])
    got = scorer.score(PROMPTS[:2], ["00", "x"])
    assert [s.reward for s in got] == [1.0, 0.0] and _Handler.calls == 2


def test_model_reward(tmp_path, tiny_actor_model):
    import torch
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
