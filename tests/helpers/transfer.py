"""A second node in a child process for the KV transfer tests: the benchmark's peer process
(kvrelay.bench.kv_transfer.Peer), with the calls a test needs to look inside it as well.

    with PeerProcess() as receiver:
        address = receiver.create("rx", "shm", config, layout, seed)
        receiver.call("expect", "rx", "t", dst)

The child runs this module (`python -m tests.helpers.transfer <folder>`) from the repository root, so it
shares no UCX, gloo or thread state with the test process, exactly as a decode node on another machine would
not. Every call has a deadline, and close() always reaps the child (SIGKILL to its group if it hangs).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from kvrelay.bench.kv_transfer import Peer, PeerHost, make_caches, serve_peer
from kvrelay.common.process import freeze
from kvrelay.kv_transfer.types import TransferError, TransferResult

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["PeerProcess", "kill_receiver_mid_transfer", "make_caches"]


class InspectableHost(PeerHost):
    """The benchmark's peer host, plus eager connects, sender waits, and reads of caches and counters."""

    def op_connect(self, key: str, peer: str, timeout: float) -> None:
        self.connectors[key].connect(peer, timeout)

    def op_wait(self, key: str, transfer_id: str, timeout: float) -> TransferResult:
        return self.connectors[key].wait(transfer_id, timeout)

    def op_caches(self, key: str) -> list[torch.Tensor]:
        # Compact (a view would carry its whole segment), as bytes: the tests compare bytes, and a float8 tensor
        # pickled by some torch builds (2.11) does not load again.
        return [c.cpu().clone().view(torch.uint8) for c in self.caches[key]]

    def op_metrics(self, key: str) -> dict[str, float]:
        return self.connectors[key].metrics.snapshot()


class PeerProcess(Peer):
    def __init__(self) -> None:
        super().__init__(module="tests.helpers.transfer", cwd=str(ROOT))


if __name__ == "__main__":
    serve_peer(InspectableHost(), sys.argv[1])


def kill_receiver_mid_transfer(sender: Peer, doomed: Peer, address: str, src: list[int], dst: list[int]) -> None:
    """A working transfer from `sender`'s "tx" to `doomed`'s "rx", then the receiver SIGSTOPped so that the next
    transfer's layers wait in its socket, then SIGKILLed: the sender's wait fails at once, not at its timeout."""
    doomed.call("expect", "rx", "t0", dst)
    sender.call("send", "tx", address, "t0", src, dst)
    sender.call("wait", "tx", "t0", 30)  # connected and working
    doomed.call("expect", "rx", "t1", dst)
    freeze(doomed.pid)  # every thread stopped: no layer of t1 is taken in
    sender.call("send", "tx", address, "t1", src, dst)
    time.sleep(0.2)
    doomed.kill()
    start = time.monotonic()
    with pytest.raises(TransferError, match="lost"):
        sender.call("wait", "tx", "t1", 15)
    assert time.monotonic() - start < 5
