"""The experience stream: trajectory codec, Redis Stream queue, embedded redis-server, replay.

Nothing is imported here, so that `buffer.redis_server` stays importable with the standard
library alone (its missing-binary error must work even where redis-py is absent).
"""
