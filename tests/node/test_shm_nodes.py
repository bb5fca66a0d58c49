"""Node processes on one host over the auto connector (shared memory): a SIGKILL of either side in the
middle of a hand-off leaks nothing. The survivor's blocks come back (the prefill node's when its transfer
fails, the decode node's through its lease), no process keeps a mapping of the dead one's KV memory, and
the survivor serves on. The nodes keep their control sockets in the test's own folder (--shm-dir).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from kvrelay.common.sampling_params import SamplingParams
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import (
    all_blocks_free,
    disaggregated,
    generate,
    in_thread,
    prefill_request,
    reserve,
    start_nodes,
    stop_nodes,
    tiny_args,
    wait_for,
)

LEASE_S = 2.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [(3 * i + 7) % 500 for i in range(150)]


def segments(pid: int) -> set[str]:
    """The KV segments a process maps (memfd names carry their owner's pid)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split()[-2].removeprefix("/memfd:kvrelay-kv-") for line in maps.splitlines()
            if "memfd:kvrelay-kv-" in line}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("shm"))


def _args(model: str, shm_dir: str) -> list[str]:
    return tiny_args(model, "auto", "--shm-dir", shm_dir, "--kv-lease-seconds", str(LEASE_S),
                     "--kv-connect-timeout", "2", "--transfer-timeout", "5")


@pytest.mark.timeout(240)
def test_decode_killed_mid_transfer(tiny_model, shm_dir):
    P, D = start_nodes([("prefill", _args(tiny_model, shm_dir)), ("decode", _args(tiny_model, shm_dir))])
    try:
        assert len(disaggregated(P, D, "warm", PROMPT, GREEDY).tokens) == 4  # connected, over shm
        assert "go over shm" in P.log_path.read_text()
        res = reserve(D, "victim", PROMPT, GREEDY)
        os.kill(D.proc.pid, signal.SIGSTOP)  # the layers wait in its socket, unacknowledged
        thread, box = in_thread(P.stub().Prefill, prefill_request("victim", PROMPT, GREEDY, res), 30)
        time.sleep(1.0)
        D.kill()
        start = time.monotonic()
        thread.join(15)
        assert not thread.is_alive() and "result" not in box, box
        assert isinstance(box["error"], grpc.RpcError) and box["error"].code() == grpc.StatusCode.UNAVAILABLE, box
        assert "lost" in box["error"].details()
        assert time.monotonic() - start < 10
        wait_for(lambda: all_blocks_free(P), 5, "the prefill node to release the blocks it held")
        assert segments(P.proc.pid) == {str(P.proc.pid)}
        assert len(generate(P, "after", PROMPT, GREEDY)[0]) == 4  # the survivor serves on
    finally:
        stop_nodes([P, D], grace=10)


@pytest.mark.timeout(240)
def test_prefill_killed_mid_transfer(tiny_model, shm_dir):
    P, D = start_nodes([("prefill", _args(tiny_model, shm_dir)), ("decode", _args(tiny_model, shm_dir))])
    try:
        assert len(disaggregated(P, D, "warm", PROMPT, GREEDY).tokens) == 4
        assert str(P.proc.pid) in segments(D.proc.pid)  # the decode node maps the prefill node's caches
        res = reserve(D, "victim", PROMPT, GREEDY)
        os.kill(D.proc.pid, signal.SIGSTOP)  # the hand-off cannot finish before the kill
        thread, box = in_thread(P.stub().Prefill, prefill_request("victim", PROMPT, GREEDY, res), 30)
        time.sleep(1.0)
        dead = P.proc.pid
        P.kill()
        os.kill(D.proc.pid, signal.SIGCONT)
        thread.join(10)
        assert isinstance(box.get("error"), grpc.RpcError), box
        wait_for(lambda: all_blocks_free(D), LEASE_S + 5, "the decode node's lease to free the reservation")
        wait_for(lambda: str(dead) not in segments(D.proc.pid), 5, "the decode node to unmap the dead node")
        assert segments(D.proc.pid) == {str(D.proc.pid)}
        assert len(generate(D, "after", PROMPT, GREEDY)[0]) == 4
    finally:
        stop_nodes([P, D], grace=10)
