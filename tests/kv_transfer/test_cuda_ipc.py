"""The parts of CUDA IPC transfer (kv_transfer/_cuda_ipc.py, _device_copy.py) that run without a GPU: the export
a hello carries crosses the control channel byte for byte and is checked before torch sees it, a receiver
refuses a sender whose memory it cannot copy from (naming both sides), the block copy moves exact bytes on
every path (run here on CPU tensors: the torch ops the GPU runs, and the fused kernel under Triton's
interpreter), and a node only sends over shm to a peer whose address names its own place (host, and GPU for
CUDA caches).

Moving blocks between two processes on a GPU: tests/kv_transfer/test_kv_transfer.py, test_gpu_ipc_*.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import socket
from pathlib import Path

import pytest
import torch

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import ConnectorConfig, TransferError, _cuda_ipc, _device_copy, create_connector
from kvrelay.kv_transfer._cuda_ipc import CudaExport, refusal
from kvrelay.kv_transfer._device_copy import RowIndices, copy_blocks
from kvrelay.kv_transfer._shm_io import Channel, parse_address
from kvrelay.kv_transfer.shm import ShmConnector
from tests.helpers.transfer import make_caches

LAYOUT = KVLayout("smollm2-test", "bfloat16", 16, 4, 2, 32, 64)
GPU = "5b1e3a2c-0f7d-4c21-9e55-0123456789ab"
# What _share_cuda_() gives, made up: NUL and high bytes in the handles, a slot near the counter file's end.
EXPORT = CudaExport(
    gpu=GPU, handle=bytes(range(64)), size=1 << 30, offset=2 << 20, ref_counter=b"/torch_1234_567_0",
    ref_counter_offset=9_999, event=bytes(range(255, 191, -1)), event_sync=True,
)

pytestmark = pytest.mark.timeout(60)


def config(folder: Path, name: str = "shm") -> ConnectorConfig:
    return ConnectorConfig(name=name, shm_dir=str(folder), connect_timeout=3, transfer_timeout=20)


def test_a_cuda_export_crosses_the_control_channel_exactly():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = Channel(left), Channel(right)
    try:
        sender.send({"k": "hello", "cuda": EXPORT.to_msg()})
        msg, fds = receiver.recv()
        assert fds == [] and CudaExport.from_msg(msg["cuda"]) == EXPORT
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(("change", "why"), [
    ({"ref_offset": 10_000}, "ref_offset is not a counter slot"),
    ({"ref_offset": -1}, "ref_offset is not a counter slot"),
    ({"ref_offset": True}, "ref_offset is not a counter slot"),
    ({"handle": "not bytes"}, "not bytes of a handle's size"),
    ({"handle": b""}, "not bytes of a handle's size"),
    ({"handle": bytes(63)}, "not bytes of a handle's size"),
    ({"event": bytes(65)}, "not bytes of a handle's size"),
    ({"ref": b"/torch\0/etc"}, "ref is not a file name"),
    ({"size": 0}, "size or offset"),
    ({"offset": 1.5}, "size or offset"),
    ({"event_sync": 1}, "event_sync is not a bool"),
    ({"gpu": 7}, "gpu is not a UUID"),
])
def test_a_malformed_export_is_refused_before_torch_sees_it(change, why):
    """torch writes through the reference counter's offset unchecked, and expects bytes where bytes go."""
    with pytest.raises(TransferError, match=f"malformed CUDA export from the sender: .*{re.escape(why)}"):
        CudaExport.from_msg(EXPORT.to_msg() | change)
    msg = EXPORT.to_msg()
    del msg["ref"]
    with pytest.raises(TransferError, match="malformed CUDA export from the sender: no 'ref'"):
        CudaExport.from_msg(msg)


def test_a_receiver_copies_only_from_its_own_gpu():
    assert refusal(EXPORT, GPU) is None
    other = "00000000-1111-2222-3333-444444444444"
    assert refusal(EXPORT, other) == (
        f"the sender's KV caches are on GPU {GPU}, this receiver's on GPU {other}: shm copies within one GPU "
        "(use ucx, or auto, between GPUs)"
    )
    assert f"on GPU {GPU}, this receiver's in host memory" in refusal(EXPORT, None)


@pytest.mark.parametrize(("cuda", "why"), [
    (EXPORT.to_msg(), f"the sender's KV caches are on GPU {GPU}, this receiver's in host memory"),
    (EXPORT.to_msg() | {"ref_offset": 123_456}, "malformed CUDA export from the sender: ref_offset"),
])
def test_a_receiver_with_host_caches_refuses_a_cuda_sender_and_says_why(tmp_path, cuda, why):
    """A real receiver, a raw hello: what a CUDA sender on this host would send it."""
    receiver = ShmConnector(config(tmp_path))
    try:
        receiver.register_kv_caches(LAYOUT, make_caches(LAYOUT, None, allocator=receiver.kv_allocator()))
        layer = LAYOUT.num_blocks * 2 * LAYOUT.block_nbytes
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(parse_address(receiver.address)[1])
        channel = Channel(sock)
        channel.send({"k": "hello", "layout": LAYOUT.to_dict(), "offsets": [i * layer for i in range(4)],
                      "size": EXPORT.size, "t": "t0", "cuda": cuda})
        reply, _ = channel.recv()
        channel.close()
        assert not reply["ok"] and why in reply["error"], reply
        receiver.expect("t0", [1])
        with pytest.raises(TransferError, match="refused sender"):
            receiver.wait_received("t0", 5)  # the transfer that came with the hello fails too
        assert receiver.metrics.refused_handshakes == 1
    finally:
        receiver.close()


# -- the copy ------------------------------------------------------------------------------------------------


def _reference(dst: torch.Tensor, src: torch.Tensor, src_ids, dst_ids, src_blocks, dst_blocks, nbytes) -> torch.Tensor:
    out = dst.clone().view(2, dst_blocks, nbytes)
    out[:, dst_ids] = src.view(2, src_blocks, nbytes)[:, src_ids]
    return out.reshape(-1)


@pytest.fixture(params=["torch", "fused"])
def means(request, monkeypatch):
    """How rows move: torch's index kernels (staging in pieces of 3 rows), or the fused Triton kernel, run by
    Triton's interpreter on CPU tensors: the kernel's own code, not a stand-in."""
    if request.param == "fused":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        _device_copy._kernel.cache_clear()  # built anew under the interpreter, and again after the test
        request.addfinalizer(_device_copy._kernel.cache_clear)
    return request.param


@pytest.mark.parametrize("block_nbytes", [64, 6])  # 8-byte words; bytes
@pytest.mark.parametrize(("src_ids", "dst_ids", "direct_runs"), [
    ([3, 9, 10, 11, 40, 2, 13], [50, 7, 8, 20, 21, 22, 0], 2),  # many runs: gather, then scatter
    ([12, 13, 14, 15], [30, 31, 32, 33], 2),  # one run: a copy per run, keys and values
    ([12, 13, 14, 15], [30, 31, 32, 33], 0),  # one run, no direct copies: gathered into the dst run
    ([5, 30, 17], [40, 41, 42], 2),  # dst one run: gathered straight into it
    ([20, 21, 22], [1, 45, 9], 2),  # src one run: scattered straight out of it
])
def test_the_block_copy_moves_exact_bytes_on_every_path(monkeypatch, means, block_nbytes, src_ids, dst_ids,
                                                        direct_runs):
    monkeypatch.setattr(_device_copy, "_STAGING_BYTES", 3 * block_nbytes)
    src_blocks, dst_blocks = 48, 64
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (2 * src_blocks * block_nbytes,), dtype=torch.uint8, generator=gen)
    for skew in (0, 1):  # the dst cache 8-byte aligned (words, where the block size allows), or not (bytes)
        backing = torch.randint(0, 256, (skew + 2 * dst_blocks * block_nbytes,), dtype=torch.uint8, generator=gen)
        dst, before = backing[skew:], backing.clone()
        expected = _reference(dst, src, src_ids, dst_ids, src_blocks, dst_blocks, block_nbytes)
        n = copy_blocks(dst, src, src_ids, dst_ids, src_blocks, dst_blocks, block_nbytes,
                        max_direct_runs=direct_runs, indices=RowIndices(), fused=means == "fused")
        assert n == 2 * len(src_ids) * block_nbytes
        assert torch.equal(dst, expected) and torch.equal(backing[:skew], before[:skew])


def test_the_block_copy_never_indexes_outside_a_cache():
    """On a GPU an index kernel out of range faults the device: the ids are checked first."""
    src, dst = torch.zeros(2 * 8 * 16, dtype=torch.uint8), torch.zeros(2 * 8 * 16, dtype=torch.uint8)
    for src_ids, dst_ids in [([1, 8], [2, 3]), ([1, 2], [-1, 3]), ([1], [2, 3])]:
        with pytest.raises(ValueError, match="outside"):
            copy_blocks(dst, src, src_ids, dst_ids, 8, 8, 16, max_direct_runs=0, indices=RowIndices(), fused=True)
    with pytest.raises(ValueError, match="outside"):  # the flat caches are smaller than their layout says
        copy_blocks(dst[:100], src, [1], [2], 8, 8, 16, max_direct_runs=0, indices=RowIndices(), fused=True)


def test_a_receiver_uses_the_fused_kernel_only_once_it_moved_rows_exactly(monkeypatch):
    """warm_up compiles the kernel for the layout's rows and checks a few rows' bytes; any failure means the
    torch means, which work everywhere. Here on CPU tensors, under Triton's interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _device_copy._kernel.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert _device_copy.warm_up(cpu, 64) and _device_copy.warm_up(cpu, 6)
        monkeypatch.setattr(_device_copy, "_copy_rows", lambda s, d, src_rows, dst_rows: d.copy_(s))  # wrong rows
        assert not _device_copy.warm_up(cpu, 64)
    finally:
        _device_copy._kernel.cache_clear()


def test_a_batch_is_what_arrived_in_full():
    """The receiver copies the layers that arrived together before acking them (one wait on its stream)."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = Channel(left), Channel(right)
    try:
        for layer in range(4):
            sender.send({"k": "layer", "l": layer})
        first, _ = receiver.recv()  # one read takes in all four
        assert first["l"] == 0
        assert [m["l"] for m in receiver.buffered(2)] == [1, 2]
        assert [m["l"] for m in receiver.buffered(10)] == [3]
        assert receiver.buffered(10) == []
    finally:
        sender.close()
        receiver.close()


# -- where a node sends over shm ---------------------------------------------------------------------------


def test_a_node_sends_over_shm_only_to_its_own_place(tmp_path):
    """A peer whose caches are on a GPU has the GPU in its address: a node with host caches (or on another GPU)
    sends to it over the remote connector (auto), and plain shm says why it cannot."""
    shm = ShmConnector(config(tmp_path))
    auto = create_connector("auto", config(tmp_path, "auto"))
    try:
        for connector in (shm, auto):
            connector.register_kv_caches(LAYOUT, make_caches(LAYOUT, 1, allocator=connector.kv_allocator()))
        assert shm.place == shm.host and parse_address(shm.address)[0] == shm.host
        on_gpu = f"shm://{shm.host}.gpu-{GPU}/{tmp_path}/kvrelay-kv-1-0.sock"
        assert auto.route(f"auto://{on_gpu}|ucx://127.0.0.1:1")[0].name == "ucx"
        assert auto.route(f"auto://{shm.address}|ucx://127.0.0.1:1")[0].name == "shm"
        shm.send_blocks(on_gpu, "t", 0, [1], [2])
        with pytest.raises(TransferError, match="keeps its KV caches on another device than this node"):
            shm.wait("t", 5)
        shm.send_blocks(f"shm://another-host.gpu-{GPU}/x.sock", "u", 0, [1], [2])
        with pytest.raises(TransferError, match="is on another host"):
            shm.wait("u", 5)
    finally:
        shm.close()
        auto.close()


def test_the_receiver_opens_an_export_as_torch_itself_does():
    """PeerCudaMemory calls UntypedStorage._new_shared_cuda with the fields of _share_cuda_() in the order
    torch.multiprocessing's rebuild_cuda_tensor does (both private torch APIs): a torch that changes the
    call fails here, on any machine, before a GPU run would."""
    from torch.multiprocessing import reductions

    def call_args(source: str) -> list[str]:
        call = re.search(r"_new_shared_cuda\((.*?)\)", source, re.S)
        assert call is not None
        return [a.strip() for a in call.group(1).split(",") if a.strip()]

    torch_args = call_args(inspect.getsource(reductions.rebuild_cuda_tensor))
    assert torch_args == ["storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
                          "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required"]
    ours = call_args(inspect.getsource(_cuda_ipc.PeerCudaMemory.__init__))
    assert ours == ["device.index", *(f"export.{f.name}" for f in dataclasses.fields(CudaExport)[1:])]


def test_the_fused_copy_compiles_for_hopper_without_a_gpu():
    # The interpreter runs the kernel's logic but checks nothing a compiler would: here it is compiled for sm_90
    # (the H100 and H200) with the ptxas that triton's wheel carries, in a process of its own.
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvrelay.kv_transfer import _device_copy

for word in ("i64", "u8"):
    sig = {"src": f"*{word}", "dst": f"*{word}", "src_rows": "*i64", "dst_rows": "*i64", "row_words": "i32",
           "BLOCK": "constexpr"}
    triton.compile(ASTSource(fn=_device_copy._kernel(), signature=sig, constexprs={"BLOCK": 128}),
                   target=GPUTarget("cuda", 90, 32))
print("compiled")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
