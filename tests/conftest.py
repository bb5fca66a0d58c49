"""Shared pytest fixtures. Heavy resources are session-scoped so each is built once per run."""

from __future__ import annotations

from pathlib import Path

import pytest

# ---------------------------------------------------------------- default model


@pytest.fixture(scope="session")
def default_model():
    """The packaged SmolLM2 GGUF, resolved once (converted into the kvrelay cache on first use)."""
    from kvrelay.model_files.resolve import resolve_model

    return resolve_model("default", progress=False)


@pytest.fixture(scope="session")
def default_model_dir(default_model) -> Path:
    """HF folder of the default model (config.json, model.safetensors, tokenizer files)."""
    return default_model.path


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from kvrelay.common.tokenizer import Tokenizer

    return Tokenizer(default_model_dir)


# ---------------------------------------------------------------- redis (block index, registry)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a unix socket for the whole run (shared/index/redis_server.py)."""
    from kvrelay.index.redis_server import start_redis

    sock = tmp_path_factory.mktemp("redis") / "redis.sock"
    with start_redis(sock) as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session redis-server, with its DB flushed before the test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushdb()
        client.script_flush()
    finally:
        client.close()
    return redis_server.url
