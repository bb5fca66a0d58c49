"""The layout handshake that opens every wire connection (shm, ucx, nccl), both sides of it.

A sender's first message names its KV layout (and the transfer that made it connect, if any). The receiver
judges it against its own layout; a refusal is counted, fails that first transfer on the receiver's side, and
goes back with the receiver's layout so that the sender's error names both sides' values too.
"""

from __future__ import annotations

import logging

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer._book import TransferBooks
from kvrelay.kv_transfer.types import LayoutMismatchError, TransferError, layout_mismatch

logger = logging.getLogger(__name__)


def judge(ours: KVLayout | None, theirs: KVLayout) -> TransferError | None:
    """Receiver: why a sender with layout `theirs` must be refused (a LayoutMismatchError naming both sides'
    values), or None to accept it."""
    if ours is None:
        return TransferError("receiver has no KV caches registered yet")
    return layout_mismatch(ours, theirs, "receiver", "sender")


def refuse(
    books: TransferBooks, ours: KVLayout | None, error: TransferError, transfer_id: str | None, kind: str
) -> dict:
    """Receiver: book a refused sender (counted; the transfer it came for, if any, fails) and return the
    reply that tells it why."""
    logger.error("refused %s sender: %s", kind, error)
    books.metrics.add(refused_handshakes=1)
    if transfer_id is not None:
        mismatches = error.mismatches if isinstance(error, LayoutMismatchError) else {}
        books.received.fail(transfer_id, LayoutMismatchError(f"refused sender: {error}", mismatches))
    return {"ok": False, "error": str(error), "layout": ours.to_dict() if ours is not None else None}


def accepted(ours: KVLayout) -> dict:
    """Receiver: the reply to a sender it accepts (a connector adds what the connection needs)."""
    return {"ok": True, "layout": ours.to_dict()}


def check_reply(reply: dict, ours: KVLayout, peer: str) -> None:
    """Sender: raise why the receiver refused this sender, if it did; a layout mismatch as a
    LayoutMismatchError naming both sides' values as the sender sees them."""
    if reply["ok"]:
        return
    theirs = reply.get("layout")
    refusal = layout_mismatch(ours, KVLayout.from_dict(theirs), "sender", "receiver") if theirs else None
    if refusal is not None:
        raise LayoutMismatchError(f"refused by receiver {peer}: {refusal}", refusal.mismatches)
    raise TransferError(f"refused by receiver {peer}: {reply['error']}")
