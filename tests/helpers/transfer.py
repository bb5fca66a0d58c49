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
from pathlib import Path

import torch

from kvrelay.bench.kv_transfer import Peer, PeerHost, make_caches, serve_peer
from kvrelay.kv_transfer.types import TransferResult

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["PeerProcess", "make_caches"]


class InspectableHost(PeerHost):
    """The benchmark's peer host, plus eager connects, sender waits, and reads of caches and counters."""

    def op_connect(self, key: str, peer: str, timeout: float) -> None:
        self.connectors[key].connect(peer, timeout)

    def op_wait(self, key: str, transfer_id: str, timeout: float) -> TransferResult:
        return self.connectors[key].wait(transfer_id, timeout)

    def op_caches(self, key: str) -> list[torch.Tensor]:
        return [c.cpu().clone() for c in self.caches[key]]  # compact: a view would carry its whole segment

    def op_metrics(self, key: str) -> dict[str, float]:
        return self.connectors[key].metrics.snapshot()


class PeerProcess(Peer):
    def __init__(self) -> None:
        super().__init__(module="tests.helpers.transfer", cwd=str(ROOT))


if __name__ == "__main__":
    serve_peer(InspectableHost(), sys.argv[1])
