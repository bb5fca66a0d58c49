"""Shared pytest fixtures, and the test tiers. Heavy resources are session-scoped so each is built once per run.

Tiers: a test that starts processes (nodes, gateways, fleets, Redis, transfer peers) is marked `fleet` here, by
what its module uses, so no test has to remember to mark itself. `make test-fast` runs the rest
(`-m "not fleet"`: unit and engine tests, for the edit loop); `make test` runs everything.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import subprocess
from pathlib import Path

import pytest

# What a test, or a fixture it uses, calls to start a process: the process helpers, Redis, subprocesses.
_STARTS_PROCESSES = re.compile(r"\b(ChildProcess|NodeProcess|GatewayProcess|start_nodes|start_redis|redis_server|"
                               r"redis_url|kvrelay_command|subprocess|multiprocessing|cli_main|run_fleet)\b")
# Folders whose every test drives processes.
_FLEET_FOLDERS = {"e2e", "node"}


@functools.cache
def _starts_processes(obj, depth: int = 3) -> bool:
    """Whether `obj` (a test, a fixture, a helper) starts a process: its source says so, or, `depth` calls deep, a
    function or class of the project's it names does."""
    parts = [c for c in inspect.getmro(obj) if c.__module__.startswith(("tests", "kvrelay"))] if inspect.isclass(obj) \
        else [obj]
    try:
        if any(_STARTS_PROCESSES.search(inspect.getsource(part)) for part in parts):
            return True
    except (OSError, TypeError):
        return False
    return depth > 0 and any(_starts_processes(o, depth - 1) for o in _named_callables(obj))


def _named_callables(obj) -> list:
    """The project's functions and classes that `obj`'s code names (module.function included)."""
    func = getattr(obj, "__func__", obj)
    code, scope = getattr(func, "__code__", None), getattr(func, "__globals__", None)
    if code is None or scope is None:
        return []
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if inspect.iscode(k))
    found = []
    for name in names:
        value = scope.get(name)
        candidates = [getattr(value, n, None) for n in names] if inspect.ismodule(value) else [value]
        candidates = [inspect.unwrap(c) if callable(c) and hasattr(c, "__wrapped__") else c for c in candidates]
        found += [v for v in candidates if (inspect.isfunction(v) or inspect.isclass(v))
                  and getattr(v, "__module__", "").startswith(("tests", "kvrelay"))]
    return found


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers on two cores) each worker's in-process engines get one
    torch thread: two OpenMP teams of two on two cores spin against each other and run slower than one of one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _process_logs_in_pytest_tmp(tmp_path_factory):
    """Started processes log under pytest's temporary folder (pruned by pytest), not one folder each in /tmp."""
    from tests.helpers import procs

    procs.LOG_ROOT = tmp_path_factory.mktemp("logs")


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = [d.func for name, defs in item._fixtureinfo.name2fixturedefs.items() for d in defs
                    if name not in ("_fast_tier_starts_no_process", "_process_logs_in_pytest_tmp")]
        if (_FLEET_FOLDERS & set(Path(item.fspath).parts)
                or any(_starts_processes(f) for f in [getattr(item, "function", None), *fixtures] if f)):
            item.add_marker(pytest.mark.fleet)


# Short-lived tools a test of the fast tier may run: the kernel loader asks ninja whether its build is current,
# `platform` asks uname, the layering test asks git.
_FAST_TIER_TOOLS = {"ninja", "c++", "g++", "gcc", "cc", "uname", "git"}


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """Under `-m "not fleet"` (make test-fast) a test that starts a process fails, naming it: the marking above
    missed it, and the fast tier would wait for processes."""
    if request.config.option.markexpr != "not fleet":
        return
    popen_init = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        argv0 = Path(str(args[0] if isinstance(args, (list, tuple)) else str(args).split()[0])).name
        if argv0 not in _FAST_TIER_TOOLS:
            pytest.fail(f"{request.node.nodeid} starts a process ({argv0}) but is not marked `fleet`: "
                        "name what starts it in tests/conftest.py's _STARTS_PROCESSES")
        popen_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


@pytest.fixture(scope="module", autouse=True)
def _release_freed_memory():
    """After each module, what its engines freed goes back to the kernel: engines built on many threads otherwise
    leave a model's worth in each malloc arena, and the run's RSS grows past the machine's memory."""
    yield
    import gc

    from kvrelay.common.system import release_freed_memory

    gc.collect()
    release_freed_memory()


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
