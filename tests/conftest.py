"""Shared fixtures, and a hermetic environment for the whole run.

Hermetic: before any test (or any module under test) is imported, HOME points at a new empty
directory, and the variables through which a developer's shell or an earlier run could steer Ray,
vLLM, torch.distributed, Hugging Face, W&B or our own job registry are cleared. A test then sees what a
fresh machine sees: no ~/.ray, no ~/.cache, no ~/.async-rlhf, whatever this machine ran before.
(pip's cache is untouched: the venv is built before pytest starts.)
"""
import os
import shutil
import tempfile
import uuid

import pytest  # neither reads the environment: the clearing below still comes first

_PREFIXES = ("RAY_", "VLLM_", "HF_", "TRANSFORMERS_", "TORCH_", "DS_", "ASYNC_RLHF_", "XDG_", "WANDB_")
_NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME",
          "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "REDIS_URL")
for _name in [n for n in os.environ if n.startswith(_PREFIXES) or n in _NAMES]:
    del os.environ[_name]
_HOME = tempfile.mkdtemp(prefix="arl-test-home-")
os.environ["HOME"] = _HOME


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)


def pytest_ignore_collect(collection_path, config):
    """`-m gpu` collects tests/test_gpu.py alone, the module of every `gpu` test: the others import
    the CPU stack at their top (Ray, Redis, vLLM), which a GPU machine set up with torch and
    transformers alone does not have (tests/test_gpu_env.py checks both)."""
    if config.getoption("markexpr") == "gpu" and collection_path.name.startswith("test_"):
        return collection_path.name != "test_gpu.py"
    return None


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run where CUDA is, and are skipped (with the reason) elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- Redis: one real redis-server for the session, a fresh stream name per test.
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from buffer.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.close()


@pytest.fixture
def redis_client(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url, decode_responses=False)
    yield client
    client.close()


@pytest.fixture
def stream_name():
    return f"test-{uuid.uuid4().hex[:12]}"


# ---- end of Redis fixtures



# ---- Actor fixtures (actors/ owners): the tiny init-model preset with its tokenizer, built once.
@pytest.fixture(scope="session")
def tiny_actor_model(tmp_path_factory):
    from actors.model_init import init_model

    return init_model(tmp_path_factory.mktemp("actor-model") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def bpe_actor_model(tmp_path_factory):
    """The tiny preset with the byte-level BPE tokenizer and its ChatML chat template."""
    from actors.model_init import init_model

    return init_model(tmp_path_factory.mktemp("actor-model") / "tiny-bpe", preset="tiny", seed=0,
                      tokenizer="bpe")


# ---- end of Actor fixtures


# ---- Learner fixtures (learners/ owners): the tiny preset with the learner tests' vocabulary,
# and a rank-0 learner on either backend fed by the real Redis stream and staleness replay.
@pytest.fixture(scope="session")
def tiny_learner_model(tmp_path_factory):
    from async_rlhf.synthetic import build_model
    from helpers import VOCAB

    path = tmp_path_factory.mktemp("tiny-learner-model")
    build_model("tiny", seed=0, vocab_size=VOCAB).save_pretrained(path)
    return str(path)


@pytest.fixture
def make_queue(redis_server, stream_name):
    """make_queue(consumer, **kwargs): a RedisExperienceQueue on this test's stream."""
    import redis

    from buffer.redis_stream import RedisExperienceQueue

    queues = []

    def make(consumer, **kwargs):
        client = redis.Redis.from_url(redis_server.url, decode_responses=False)
        queues.append(RedisExperienceQueue(client, consumer, stream=stream_name, **kwargs))
        return queues[-1]

    yield make
    for q in queues:
        q.close()


@pytest.fixture
def make_learner(tiny_learner_model, make_queue):
    """make_learner(groups, backend="torch"|"deepspeed", ...): a rank-0 learner (groups of 4)
    whose stream already holds `groups`; returns (learner, queue, publisher)."""
    from async_rlhf.config import LearnerConfig
    from buffer.replay import StalenessReplay
    from helpers import RecordingPublisher
    from learners.learner import Learner

    def make(groups=(), backend="torch", max_staleness=2, temperature=1.0, dtype="float32", **overrides):
        if backend == "torch":
            from learners.torch_backend import TorchBackend as Backend
        else:
            from learners.deepspeed_backend import DeepSpeedBackend as Backend
        cfg = LearnerConfig(**{"batch_size": 8, "micro_batch": 4, "lr": 3e-3, **overrides})
        be = Backend(cfg, tiny_learner_model, temperature=temperature, dtype=dtype)
        queue, publisher = make_queue("learner-0"), RecordingPublisher()
        queue.put(groups)
        learner = Learner(cfg, be, max_staleness=max_staleness, group_size=4, queue=queue,
                          replay=StalenessReplay(max_reuse=cfg.max_reuse, max_staleness=max_staleness),
                          publisher=publisher)
        return learner, queue, publisher

    return make


# ---- end of Learner fixtures
