"""A connector's caches as the connections of the byte-moving wire connectors (ucx, nccl) see them.

A sender's connection reads each queued layer out of the caches (as segments: runs in place, the rest
gathered into staging) behind one header that announces it; a receiver's connection lands the announced
layer in the caches, and only where the receiver's book of expected transfers lets it. The connections get
this at construction and never touch their connector otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import _blocks
from kvrelay.kv_transfer._book import TransferBook
from kvrelay.kv_transfer.types import ConnectorConfig, TransferError


@dataclass
class Job:
    """One layer that send_blocks queued for a peer."""

    transfer_id: str
    layer: int
    src: list[int]
    dst: list[int]
    ready: torch.cuda.Event | None  # CUDA: the layer's kernels were only enqueued; wait for this first


@dataclass(frozen=True)
class OutgoingLayer:
    header: dict  # the control message announcing the layer: transfer, layer, dst blocks, segments
    sources: list[torch.Tensor]  # one contiguous tensor per segment, in order
    release: Callable[[], None]  # call once the wire is done with the sources, and only then
    nbytes: int


@dataclass(frozen=True)
class Landing:
    buffers: list[torch.Tensor]  # one per announced segment, in order: receive into these
    refusal: str | None  # why the layer is refused (its bytes are drained and dropped), or None


@dataclass(frozen=True)
class WireCaches:
    """A connector's registered caches and what moving them takes: its config, staging pool, and its book of
    received transfers (a layer lands only where that book lets it)."""

    config: ConnectorConfig
    layout: KVLayout
    caches: tuple[torch.Tensor, ...]
    staging: _blocks.StagingPool
    received: TransferBook

    def job(self, transfer_id: str, layer: int, src: list[int], dst: list[int]) -> Job:
        return Job(transfer_id, layer, list(src), list(dst), _blocks.ready_event(self.caches[layer]))

    def outgoing(self, job: Job) -> OutgoingLayer:
        """Sender: the layer's segments and the header announcing them (its job's ready event has passed)."""
        max_blocks = self.config.max_message_blocks(self.layout)
        segments = _blocks.plan_segments(job.src, self.config.max_direct_runs, max_blocks)
        sources, release = _blocks.layer_sources(self.caches[job.layer], job.src, segments, self.staging)
        header = {"kind": "layer", "transfer_id": job.transfer_id, "layer": job.layer, "dst": job.dst,
                  "segments": [s.to_list() for s in segments]}
        return OutgoingLayer(header, sources, release, sum(s.numel() * s.element_size() for s in sources))

    @contextmanager
    def landing(self, header: dict) -> Iterator[Landing]:
        """Receiver: admit an announced layer. The caller receives every segment into the buffers within the
        block; on leaving it normally the bytes are placed and the layer booked, or, if it was refused, the
        transfer fails. On an error nothing is booked (the caller drops the connection)."""
        transfer_id, layer, dst = header["transfer_id"], header["layer"], header["dst"]
        segments = [_blocks.Segment.from_list(s) for s in header["segments"]]
        with self.received.admitting(transfer_id, layer, dst) as refusal:
            buffers, complete = _blocks.layer_sinks(
                self.caches[layer], dst, segments, self.staging, refusal is not None
            )
            yield Landing(buffers, refusal)
            nbytes = complete()
            if refusal is None:
                self.received.layer_done(transfer_id, layer, nbytes)
        if refusal is not None:
            self.received.fail(transfer_id, TransferError(refusal))
