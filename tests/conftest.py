# ---- Redis fixtures (buffer/ owners): one real redis-server for the session, a fresh stream
# name per test. Others: add your fixtures below this block.
import uuid

import pytest


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


# ---- end of Actor fixtures
