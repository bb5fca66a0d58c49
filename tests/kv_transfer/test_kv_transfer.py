"""KV transfer connectors: exact block contents, byte counts, layout refusal and unreachable peers.

The wire connectors (ucx over tcp and shared memory, nccl on gloo) run between two spawned processes, so
nothing is shared but the loopback interface. Both processes are reused across tests (module fixture).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvrelay.common.records import KVLayout
from kvrelay.common.system import free_port
from kvrelay.kv_transfer import (
    ConnectorConfig,
    LayoutMismatchError,
    TransferError,
    create_connector,
)
from kvrelay.kv_transfer._blocks import BOTH, Segment, block_runs, plan_segments
from kvrelay.kv_transfer.types import layout_mismatch
from tests.helpers.transfer import PeerProcess, kill_receiver_mid_transfer, make_caches

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 4, 64, 16, 2, 32
# Non-contiguous on both sides, in no particular order: exercises gather on send and scatter on receive.
SCATTERED = ([3, 9, 10, 11, 40, 2, 63], [50, 7, 8, 20, 21, 22, 0])
# One run on each side: exercises the zero-copy path (send from and receive into the cache directly).
RUNS = ([12, 13, 14, 15], [30, 31, 32, 33])
SENDER_SEED, RECEIVER_SEED = 1, 2

pytestmark = pytest.mark.timeout(60)  # a hang fails fast; slower tests raise their own limit


def layout(dtype: str, **changes: object) -> KVLayout:
    fields = dict(
        model_id="smollm2-test",
        dtype=dtype,
        block_size=BLOCK_SIZE,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        num_blocks=NUM_BLOCKS,
    )
    return KVLayout(**(fields | changes))


def expected_nbytes(dtype: str, num_blocks: int) -> int:
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return num_blocks * LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_SIZE * itemsize


def assert_blocks_moved(
    src: list[torch.Tensor], before: list[torch.Tensor], after: list[torch.Tensor], transfers: list
) -> None:
    """dst blocks hold exactly the src bytes; every other receiver block is untouched."""
    written: set[int] = set()
    for src_ids, dst_ids in transfers:
        written |= set(dst_ids)
        for layer in range(LAYERS):
            got = after[layer][:, dst_ids].contiguous().view(torch.uint8)
            assert torch.equal(got, src[layer][:, src_ids].contiguous().view(torch.uint8)), f"layer {layer}"
    others = [b for b in range(NUM_BLOCKS) if b not in written]
    for layer in range(LAYERS):
        assert torch.equal(
            after[layer][:, others].view(torch.uint8), before[layer][:, others].view(torch.uint8)
        )


# -- pure logic --------------------------------------------------------------------------------------------


def test_layout_mismatch_names_both_values() -> None:
    mine, theirs = layout("bfloat16"), layout("float32", head_size=64, num_blocks=7)
    error = layout_mismatch(mine, theirs, "decode", "prefill")
    assert isinstance(error, LayoutMismatchError)
    message = str(error)
    assert "dtype: decode='bfloat16' prefill='float32'" in message
    assert "head_size: decode=32 prefill=64" in message
    assert "num_blocks" not in message  # only block ids cross the wire
    assert set(error.mismatches) == {"dtype", "head_size"}
    assert layout_mismatch(mine, layout("bfloat16", num_blocks=999), "decode", "prefill") is None


def test_unknown_connector_lists_choices() -> None:
    with pytest.raises(ValueError, match="auto, local, nccl, shm, ucx"):
        create_connector("rdma")


def test_block_runs_and_segments() -> None:
    assert block_runs([3, 4, 5, 9, 2, 3]) == [(0, 3, 3), (3, 9, 1), (4, 2, 2)]
    assert plan_segments([7, 8, 9], 2, 8) == [Segment(0, 0, 3), Segment(1, 0, 3)]
    assert plan_segments([1, 5, 9], 2, 8) == [Segment(BOTH, 0, 3)]
    # Messages are capped at max_message_blocks K or V blocks (a BOTH message holds both).
    assert plan_segments([7, 8, 9], 2, 2) == [
        Segment(0, 0, 2),
        Segment(1, 0, 2),
        Segment(0, 2, 1),
        Segment(1, 2, 1),
    ]
    assert plan_segments([1, 5, 9, 11, 13], 2, 4) == [
        Segment(BOTH, 0, 2),
        Segment(BOTH, 2, 2),
        Segment(BOTH, 4, 1),
    ]


# -- local (in-process) ------------------------------------------------------------------------------------


def local_pair(sender_layout: KVLayout, receiver_layout: KVLayout, device: str = "cpu") -> tuple:
    sender, receiver = create_connector("local"), create_connector("local")
    src = make_caches(sender_layout, SENDER_SEED, device)
    dst = make_caches(receiver_layout, RECEIVER_SEED, device)
    sender.register_kv_caches(sender_layout, src)
    receiver.register_kv_caches(receiver_layout, dst)
    return sender, receiver, src, dst


def run_local_transfers(dtype: str, device: str = "cpu") -> None:
    sender, receiver, src, dst = local_pair(layout(dtype), layout(dtype), device)
    before = [c.clone() for c in dst]
    for i, (src_ids, dst_ids) in enumerate([SCATTERED, RUNS]):
        receiver.expect(f"t{i}", dst_ids)
        for layer in range(LAYERS):
            sender.send_blocks(receiver.address, f"t{i}", layer, src_ids, dst_ids)
        sent, received = sender.wait(f"t{i}", timeout=5), receiver.wait_received(f"t{i}", timeout=5)
        assert sent.nbytes == received.nbytes == expected_nbytes(dtype, len(src_ids))
    assert_blocks_moved(
        [c.cpu() for c in src], [c.cpu() for c in before], [c.cpu() for c in dst], [SCATTERED, RUNS]
    )
    total = expected_nbytes(dtype, len(SCATTERED[0]) + len(RUNS[0]))
    assert sender.metrics.bytes_sent == receiver.metrics.bytes_received == total
    assert sender.metrics.failures == receiver.metrics.failures == 0
    sender.close()
    receiver.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_local_transfer(dtype: str) -> None:
    run_local_transfers(dtype)


@pytest.mark.timeout(30)
def test_local_layout_mismatch_refused_on_both_sides() -> None:
    sender, receiver, _, _ = local_pair(layout("bfloat16"), layout("float32"))
    receiver.expect("t", [1, 2])
    sender.send_blocks(receiver.address, "t", 0, [5, 6], [1, 2])
    for side in (lambda: sender.wait("t", 2), lambda: receiver.wait_received("t", 2)):
        with pytest.raises(LayoutMismatchError, match="bfloat16") as info:
            side()
        assert "float32" in str(info.value)
    assert sender.metrics.refused_handshakes == receiver.metrics.refused_handshakes == 1
    sender.close()
    receiver.close()


@pytest.mark.timeout(30)
def test_receiver_refuses_blocks_it_did_not_reserve() -> None:
    sender, receiver, _, dst = local_pair(layout("float32"), layout("float32"))
    before = dst[0].clone()
    receiver.expect("t", [1, 2])
    sender.send_blocks(receiver.address, "t", 0, [5, 6], [1, 3])
    with pytest.raises(TransferError, match="not reserved"):
        sender.wait("t", 2)
    with pytest.raises(TransferError, match="not reserved"):
        receiver.wait_received("t", 2)
    assert torch.equal(dst[0], before)
    sender.close()
    receiver.close()


@pytest.mark.timeout(30)
def test_waits_are_bounded() -> None:
    sender, receiver, _, _ = local_pair(layout("float32"), layout("float32"))
    receiver.expect("t", [1])
    receiver.expect("u", [1])
    start = time.monotonic()
    with pytest.raises(TransferError, match="timed out"):
        receiver.wait_received("t", timeout=0.2)
    sender.send_blocks(receiver.address, "u", 0, [1], [1])  # 1 of 4 layers: never complete
    with pytest.raises(TransferError, match="timed out"):
        sender.wait("u", timeout=0.2)
    assert time.monotonic() - start < 2
    sender.send_blocks("local://nobody", "v", 0, [1], [1])
    with pytest.raises(TransferError, match="unreachable"):
        sender.wait("v", timeout=1)
    assert sender.metrics.failures == 2 and receiver.metrics.failures == 1
    sender.close()
    receiver.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("release", ["abandon_received", "wait_received"])
def test_blocks_are_released_only_once_no_admitted_layer_is_landing(release: str) -> None:
    """A layer the receiver let in before its request left still writes into the reserved blocks. Both ways of
    letting go of a transfer (abandoning it, or a wait that fails) return only once that write is over, so
    the engine never frees blocks a layer is about to land in; layers arriving meanwhile are refused.
    A wire cannot be paused between a layer's header and its bytes on demand, so the layer in flight is
    held open through the connector's own books, as a wire receive does."""
    sender, receiver, _, _ = local_pair(layout("float32"), layout("float32"))
    receiver.expect("t", [1, 2])
    book = receiver.books.received
    assert book.check_layer("t", 0, [1, 2]) is None  # layer 0's bytes are on their way into blocks 1 and 2
    answers: list[TransferError] = []
    returned = threading.Event()

    def let_go() -> None:
        try:
            if release == "abandon_received":
                receiver.abandon_received("t")
            else:
                receiver.wait_received("t", timeout=0.1)
        except TransferError as e:
            answers.append(e)
        returned.set()

    thread = threading.Thread(target=let_go)
    thread.start()
    assert not returned.wait(0.5), "the transfer was let go while a layer was still landing in its blocks"
    assert book.check_layer("t", 1, [1, 2]) is not None  # a later layer is refused
    book.landed("t")
    assert returned.wait(5)
    thread.join()
    assert [type(e) for e in answers] == ([] if release == "abandon_received" else [TransferError])
    assert book.wait_landed("t", 0)
    sender.close()
    receiver.close()


@pytest.mark.timeout(30)
def test_second_waiter_is_refused() -> None:
    """One waiter per transfer: its answer closes the record, so a second would find it gone at the end."""
    sender, receiver, _, _ = local_pair(layout("float32"), layout("float32"))
    receiver.expect("t", [1])
    sender.send_blocks(receiver.address, "t", 0, [1], [1])  # 1 of 4 layers: the first waiter stays
    answers: list[BaseException] = []

    def first_waiter() -> None:
        try:
            sender.wait("t", 1.0)
        except BaseException as e:  # noqa: BLE001 - checked below
            answers.append(e)

    first = threading.Thread(target=first_waiter)
    first.start()
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match="already has a waiter"):
        sender.wait("t", 1.0)
    first.join()
    assert len(answers) == 1 and isinstance(answers[0], TransferError) and "timed out" in str(answers[0])
    assert sender.metrics.failures == 1  # the first waiter's timeout only
    sender.close()
    receiver.close()


# -- wire connectors between two processes -----------------------------------------------------------------

WIRE = {
    "ucx-tcp": ("ucx", ConnectorConfig(name="ucx", transport="tcp", connect_timeout=3, transfer_timeout=20)),
    "ucx-shm": ("ucx", ConnectorConfig(name="ucx", transport="shm", connect_timeout=3, transfer_timeout=20)),
    "gloo": ("nccl", ConnectorConfig(name="nccl", connect_timeout=3, transfer_timeout=20)),
    "shm": ("shm", ConnectorConfig(name="shm", connect_timeout=3, transfer_timeout=20)),
    # CUDA caches: torch's gather/scatter kernels rather than the fused one (the same on host caches)
    "shm-index": ("shm", ConnectorConfig(name="shm", connect_timeout=3, transfer_timeout=20, fused_copy=False)),
    "auto": ("auto", ConnectorConfig(name="auto", connect_timeout=3, transfer_timeout=20)),
    # auto without ucxx (GPU images may lack it): on one GPU its remote part goes unused
    "auto-nccl": ("auto", ConnectorConfig(name="auto", remote="nccl", connect_timeout=3, transfer_timeout=20)),
}


@pytest.fixture(scope="module")
def peers():
    sender_host, receiver_host = PeerProcess(), PeerProcess()
    try:
        yield sender_host, receiver_host
    finally:
        sender_host.close()
        receiver_host.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("wire", "dtype"),
    [("ucx-tcp", "bfloat16"), ("ucx-shm", "float32"), ("gloo", "bfloat16"), ("shm", "bfloat16"), ("auto", "float32")],
)
def test_wire_transfer_between_processes(peers, wire: str, dtype: str) -> None:
    run_wire_transfers(peers, wire, dtype, "cpu", [SCATTERED, RUNS])


def run_wire_transfers(peers, wire: str, dtype: str, device: str, transfers: list) -> None:
    """One transfer after another, each checked by its byte counts on both sides; then every dst block holds
    exactly its src bytes, and no other block changed."""
    sender_host, receiver_host = peers
    name, config = WIRE[wire]
    kv_layout = layout(dtype)
    address = receiver_host.create("rx", name, config, kv_layout, RECEIVER_SEED, device)
    sender_host.create("tx", name, config, kv_layout, SENDER_SEED, device)
    try:
        for i, (src_ids, dst_ids) in enumerate(transfers):
            receiver_host.call("expect", "rx", f"t{i}", dst_ids)
            sender_host.call("send", "tx", address, f"t{i}", src_ids, dst_ids)
            sent = sender_host.call("wait", "tx", f"t{i}", 30)
            received = receiver_host.call("wait_received", "rx", f"t{i}", 30)
            assert sent.nbytes == received.nbytes == expected_nbytes(dtype, len(src_ids))
        after = receiver_host.call("caches", "rx")
        src, before = make_caches(kv_layout, SENDER_SEED), make_caches(kv_layout, RECEIVER_SEED)
        assert_blocks_moved(src, before, after, transfers)
        total = expected_nbytes(dtype, sum(len(src_ids) for src_ids, _ in transfers))
        assert sender_host.call("metrics", "tx")["bytes_sent"] == total
        assert receiver_host.call("metrics", "rx")["bytes_received"] == total
    finally:
        sender_host.call("close", "tx")
        receiver_host.call("close", "rx")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire", ["ucx-tcp", "gloo", "shm"])
def test_wire_layout_mismatch_refused_on_both_sides(peers, wire: str) -> None:
    sender_host, receiver_host = peers
    name, config = WIRE[wire]
    address = receiver_host.create("rx", name, config, layout("float32"), RECEIVER_SEED)
    sender_host.create("tx", name, config, layout("bfloat16", num_kv_heads=4), SENDER_SEED)
    try:
        with pytest.raises(LayoutMismatchError, match="num_kv_heads"):
            sender_host.call("connect", "tx", address, 10)  # the eager handshake refuses too
        receiver_host.call("expect", "rx", "t", [1, 2])
        sender_host.call("send", "tx", address, "t", [5, 6], [1, 2])
        for host, op, key in [(sender_host, "wait", "tx"), (receiver_host, "wait_received", "rx")]:
            with pytest.raises(LayoutMismatchError) as info:
                host.call(op, key, "t", 15)
            message = str(info.value)
            assert "'bfloat16'" in message and "'float32'" in message, message
            assert "num_kv_heads" in message and "=4" in message and "=2" in message, message
    finally:
        sender_host.call("close", "tx")
        receiver_host.call("close", "rx")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire", ["ucx-tcp", "gloo"])
def test_wire_unreachable_peer_fails_within_timeout(peers, wire: str) -> None:
    sender_host, _ = peers
    name, config = WIRE[wire]
    sender_host.create("tx", name, config, layout("float32"), SENDER_SEED)
    try:
        start = time.monotonic()
        sender_host.call("send", "tx", f"{name}://127.0.0.1:{free_port()}", "t", [1], [1])
        with pytest.raises(TransferError, match="cannot connect"):
            sender_host.call("wait", "tx", "t", config.connect_timeout + 10)
        assert time.monotonic() - start < config.connect_timeout + 8
    finally:
        sender_host.call("close", "tx")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire", ["ucx-tcp", "gloo", "shm"])
def test_wire_peer_death_fails_transfers_without_hanging(peers, wire: str) -> None:
    sender_host, _ = peers
    name, config = WIRE[wire]
    kv_layout = layout("float32")
    with PeerProcess() as doomed:
        address = doomed.create("rx", name, config, kv_layout, RECEIVER_SEED)
        sender_host.create("tx", name, config, kv_layout, SENDER_SEED)
        try:
            doomed.call("expect", "rx", "t0", RUNS[1])
            sender_host.call("send", "tx", address, "t0", *RUNS)
            sender_host.call("wait", "tx", "t0", 30)  # connected and working
            doomed.kill()
            start = time.monotonic()
            sender_host.call("send", "tx", address, "t1", *RUNS)
            with pytest.raises(TransferError):
                sender_host.call("wait", "tx", "t1", config.transfer_timeout)
            assert time.monotonic() - start < config.transfer_timeout
        finally:
            sender_host.call("close", "tx")


@pytest.mark.timeout(60)
def test_ucx_transport_is_per_process_until_released(peers) -> None:
    host, _ = peers
    host.create("a", "ucx", WIRE["ucx-tcp"][1], layout("float32"), None)
    with pytest.raises(TransferError, match="one transport per process"):
        host.create("b", "ucx", WIRE["ucx-shm"][1], layout("float32"), None)
    host.call("close", "a")
    assert host.create("b", "ucx", WIRE["ucx-shm"][1], layout("float32"), None).startswith("ucx://")
    host.call("close", "b")


# -- GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_transfers(peers) -> None:
    run_local_transfers("bfloat16", device="cuda")
    sender_host, receiver_host = peers
    config = ConnectorConfig(name="ucx", transport="auto", connect_timeout=5, transfer_timeout=30)
    kv_layout = layout("bfloat16")
    address = receiver_host.create("rx", "ucx", config, kv_layout, RECEIVER_SEED, "cuda")
    sender_host.create("tx", "ucx", config, kv_layout, SENDER_SEED, "cuda")
    try:
        receiver_host.call("expect", "rx", "t", SCATTERED[1])
        sender_host.call("send", "tx", address, "t", *SCATTERED)
        assert sender_host.call("wait", "tx", "t", 30).nbytes == expected_nbytes(
            "bfloat16", len(SCATTERED[0])
        )
        receiver_host.call("wait_received", "rx", "t", 30)
        after = receiver_host.call("caches", "rx")
        assert_blocks_moved(
            make_caches(kv_layout, SENDER_SEED), make_caches(kv_layout, RECEIVER_SEED), after, [SCATTERED]
        )
    finally:
        sender_host.call("close", "tx")
        receiver_host.call("close", "rx")


# Every shape of block list the CUDA IPC copy has a path for: many runs (gather, then scatter), one run on both
# sides (a memcpy per run), one run on the dst side only (gathered straight into it), on the src side only
# (scattered straight out of it). The dst blocks of the four are disjoint.
GPU_TRANSFERS = [SCATTERED, RUNS, ([5, 30, 17], [40, 41, 42]), ([20, 21, 22], [1, 45, 9])]


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("wire", "dtype"), [
    ("shm", "bfloat16"), ("shm", "float8_e4m3fn"), ("shm-index", "bfloat16"), ("shm-index", "float8_e4m3fn"),
    ("auto-nccl", "bfloat16"),
])
def test_gpu_ipc_transfer_between_processes(peers, wire: str, dtype: str) -> None:
    """Two processes on one GPU: shm, and auto, which picks shm there, move the blocks by CUDA IPC, byte-exact,
    by either means of copying scattered blocks, fp8 (which has no index kernels of its own: its bytes move)
    too."""
    run_wire_transfers(peers, wire, dtype, "cuda", GPU_TRANSFERS)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ipc_receiver_killed_mid_transfer_fails_the_sender_at_once(peers) -> None:
    """SIGSTOP a receiver that has the sender's CUDA memory open, so a transfer's layers wait in its socket,
    then SIGKILL it: the sender's wait fails at once (not at its timeout), and the sender goes on sending to
    another receiver."""
    sender_host, receiver_host = peers
    name, config = WIRE["shm"]
    kv_layout = layout("bfloat16")
    sender_host.create("tx", name, config, kv_layout, SENDER_SEED, "cuda")
    try:
        with PeerProcess() as doomed:
            address = doomed.create("rx", name, config, kv_layout, RECEIVER_SEED, "cuda")
            kill_receiver_mid_transfer(sender_host, doomed, address, *SCATTERED)  # it had the sender's memory open
        address = receiver_host.create("rx", name, config, kv_layout, RECEIVER_SEED, "cuda")
        try:
            receiver_host.call("expect", "rx", "t2", RUNS[1])
            sender_host.call("send", "tx", address, "t2", *RUNS)
            assert sender_host.call("wait", "tx", "t2", 30).nbytes == expected_nbytes("bfloat16", len(RUNS[0]))
            receiver_host.call("wait_received", "rx", "t2", 30)
        finally:
            receiver_host.call("close", "rx")
    finally:
        sender_host.call("close", "tx")
