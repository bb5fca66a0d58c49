"""The same-host connector (kv_transfer/shm.py) and the auto connector that picks it.

Real processes (tests.helpers.transfer.PeerProcess), real shared memory, real SIGKILL / SIGSTOP: a receiver
never writes outside what it reserved, refuses layers of a closed transfer, and a crash of either side
fails the survivor's transfers at once and leaves no mapping of the dead side's memory behind. Each test
keeps its control sockets in its own folder (shm_dir), so nothing else on the machine interferes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import ConnectorConfig, TransferError, create_connector
from kvrelay.kv_transfer._shm_io import parse_address
from kvrelay.kv_transfer.shm import ShmConnector
from tests.helpers.transfer import PeerProcess, kill_receiver_mid_transfer, make_caches

LAYOUT = KVLayout("smollm2-test", "bfloat16", 16, 4, 2, 32, 64)
SRC, DST = [3, 9, 10, 11, 40], [50, 7, 8, 20, 21]
SENDER_SEED, RECEIVER_SEED = 1, 2

pytestmark = pytest.mark.timeout(90)


def config(folder: Path, name: str = "shm") -> ConnectorConfig:
    return ConnectorConfig(name=name, shm_dir=str(folder), connect_timeout=3, transfer_timeout=20)


def peer_mappings(pid: int) -> set[str]:
    """The KV segments a process maps (memfd names carry their owner's pid)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split()[-2] for line in maps.splitlines() if "memfd:kvrelay-kv-" in line}


def segment_of(pid: int) -> str:
    return f"/memfd:kvrelay-kv-{pid}"


@pytest.fixture
def pair(tmp_path):
    with PeerProcess() as sender, PeerProcess() as receiver:
        address = receiver.create("rx", "shm", config(tmp_path), LAYOUT, RECEIVER_SEED)
        sender.create("tx", "shm", config(tmp_path), LAYOUT, SENDER_SEED)
        yield sender, receiver, address


def test_caches_live_in_shared_memory_and_the_receiver_maps_the_sender(pair):
    sender, receiver, address = pair
    receiver.call("expect", "rx", "t", DST)
    sender.call("send", "tx", address, "t", SRC, DST)
    assert sender.call("wait", "tx", "t", 20).nbytes == receiver.call("wait_received", "rx", "t", 20).nbytes
    after, src = receiver.call("caches", "rx"), make_caches(LAYOUT, SENDER_SEED)
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(after[layer][:, DST].view(torch.uint8), src[layer][:, SRC].view(torch.uint8))
    assert peer_mappings(receiver.pid) == {segment_of(receiver.pid), segment_of(sender.pid)}
    assert peer_mappings(sender.pid) == {segment_of(sender.pid)}  # a sender maps nothing of its peers


def test_receiver_refuses_blocks_it_did_not_reserve(pair):
    sender, receiver, address = pair
    receiver.call("expect", "rx", "t", [1, 2])
    sender.call("send", "tx", address, "t", [5, 6], [1, 3])
    for host, op, key in [(sender, "wait", "tx"), (receiver, "wait_received", "rx")]:
        with pytest.raises(TransferError, match=r"dst blocks \[3\] were not reserved"):
            host.call(op, key, "t", 10)
    before, after = make_caches(LAYOUT, RECEIVER_SEED), receiver.call("caches", "rx")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before))


def test_a_closed_transfer_takes_no_late_layer(pair):
    sender, receiver, address = pair
    receiver.call("expect", "rx", "late", DST)
    with pytest.raises(TransferError, match="timed out"):
        receiver.call("wait_received", "rx", "late", 0)  # closed, as a lapsed lease or an abort does
    sender.call("send", "tx", address, "late", SRC, DST)
    with pytest.raises(TransferError, match="not expected by the receiver"):
        sender.call("wait", "tx", "late", 10)
    before, after = make_caches(LAYOUT, RECEIVER_SEED), receiver.call("caches", "rx")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before))


def test_sender_killed_mid_transfer(tmp_path):
    """SIGKILL the sender with half the layers sent: the receiver's transfer fails at once (not at its
    timeout) and it unmaps the dead sender's memory."""
    with PeerProcess() as receiver:
        address = receiver.create("rx", "shm", config(tmp_path), LAYOUT, RECEIVER_SEED)
        with PeerProcess() as doomed:
            doomed.create("tx", "shm", config(tmp_path), LAYOUT, SENDER_SEED)
            receiver.call("expect", "rx", "t0", DST)
            doomed.call("send", "tx", address, "t0", SRC, DST, [0, 1])  # 2 of 4 layers
            deadline = time.monotonic() + 10
            while segment_of(doomed.pid) not in peer_mappings(receiver.pid):
                assert time.monotonic() < deadline, "the receiver never mapped the sender's segment"
                time.sleep(0.05)
            dead = doomed.pid
            doomed.kill()
        start = time.monotonic()
        with pytest.raises(TransferError, match="connection to sender lost"):
            receiver.call("wait_received", "rx", "t0", 15)
        assert time.monotonic() - start < 5
        assert peer_mappings(receiver.pid) == {segment_of(receiver.pid)}, f"still maps {dead}'s segment"


def test_receiver_killed_mid_transfer(tmp_path):
    """SIGSTOP the receiver so the layers wait in its socket, then SIGKILL it: the sender's wait fails at
    once, and the dead receiver's control socket is swept by the next connector that starts there."""
    with PeerProcess() as sender, PeerProcess() as doomed:
        address = doomed.create("rx", "shm", config(tmp_path), LAYOUT, RECEIVER_SEED)
        sender.create("tx", "shm", config(tmp_path), LAYOUT, SENDER_SEED)
        kill_receiver_mid_transfer(sender, doomed, address, SRC, DST)
        assert peer_mappings(sender.pid) == {segment_of(sender.pid)}
    stale = list(tmp_path.glob("kvrelay-kv-*.sock"))
    assert len(stale) == 1  # the killed receiver's (the sender's was unlinked by its close)
    os.utime(stale[0], (time.time() - 60, time.time() - 60))  # old enough to be judged
    fresh = ShmConnector(config(tmp_path))
    try:
        assert not stale[0].exists()
    finally:
        fresh.close()
    assert not list(tmp_path.glob("kvrelay-kv-*.sock"))


def test_auto_uses_shm_on_one_host_and_the_remote_connector_across(tmp_path):
    """Two auto connectors that see the same socket folder use shm; one that sees another folder (as a
    container with its own /dev/shm would) goes over ucx. Both paths move the same bytes."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    made, caches = [], []
    try:
        for folder, seed in [("a", SENDER_SEED), ("a", RECEIVER_SEED), ("b", RECEIVER_SEED)]:
            connector = create_connector("auto", config(tmp_path / folder, "auto"))
            made.append(connector)
            caches.append(make_caches(LAYOUT, seed, allocator=connector.kv_allocator()))
            connector.register_kv_caches(LAYOUT, caches[-1])
        sender, near, far = made
        assert sender.route(near.address)[0].name == "shm"
        assert sender.route(far.address)[0].name == "ucx"
        src = make_caches(LAYOUT, SENDER_SEED)
        for i, (receiver, received) in enumerate([(near, caches[1]), (far, caches[2])]):
            receiver.expect(f"t{i}", DST)
            for layer in range(LAYOUT.num_layers):
                sender.send_blocks(receiver.address, f"t{i}", layer, SRC, DST)
            assert sender.wait(f"t{i}", 20).nbytes == receiver.wait_received(f"t{i}", 20).nbytes
            for layer in range(LAYOUT.num_layers):
                got = received[layer][:, DST].view(torch.uint8)
                assert torch.equal(got, src[layer][:, SRC].view(torch.uint8))
    finally:
        for connector in made:
            connector.close()


def test_copy_plan_merges_runs_and_both_copy_paths_move_the_same_bytes(monkeypatch):
    import numpy as np

    from kvrelay.common import native
    from kvrelay.kv_transfer import _shm_io

    plan = _shm_io.copy_plan([4, 5, 6, 9, 2], [10, 11, 12, 13, 0], src_blocks=16, dst_blocks=20, block_nbytes=8)
    dst_off, src_off, sizes = (a.tolist() for a in plan)
    # [4,5,6]->[10,11,12] is one run; 9->13 and 2->0 are single blocks; then the same for values.
    assert src_off == [32, 72, 16, 160, 200, 144] and dst_off == [80, 104, 0, 240, 264, 160]
    assert sizes == [24, 8, 8, 24, 8, 8]
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, 2 * 16 * 8, dtype=np.uint8)
    results = []
    for lib in (native.load(), None):
        monkeypatch.setattr(native, "load", lambda lib=lib: lib)  # the compiled path, then the numpy fallback
        dst = np.zeros(2 * 20 * 8, dtype=np.uint8)
        assert _shm_io.copy_blocks(dst, src, plan) == 5 * 2 * 8
        results.append(dst)
    assert np.array_equal(results[0], results[1])
    assert np.array_equal(results[1][80:104], src[32:56]) and not results[1][8:80].any()
    with pytest.raises(ValueError, match="outside"):
        _shm_io.copy_blocks(np.zeros(10, dtype=np.uint8), src, plan)


def test_a_segment_that_could_shrink_is_refused(tmp_path):
    """A sender whose segment is not sealed against shrinking (or smaller than it claims) is refused: a
    mapping past a file's end would crash the receiver with SIGBUS when touched."""
    import socket

    from kvrelay.kv_transfer._shm_io import Channel
    from kvrelay.kv_transfer.shm import parse_address

    receiver = ShmConnector(config(tmp_path))
    receiver.register_kv_caches(LAYOUT, make_caches(LAYOUT, None, allocator=receiver.kv_allocator()))
    size = 4 * LAYOUT.num_blocks * 2 * LAYOUT.block_nbytes
    fd = os.memfd_create("kvrelay-kv-test")  # no seals
    os.ftruncate(fd, size)
    layer = LAYOUT.num_blocks * 2 * LAYOUT.block_nbytes
    hello = {"k": "hello", "layout": LAYOUT.to_dict(), "offsets": [i * layer for i in range(4)], "size": size,
             "t": None}
    try:
        for claimed in (size, size * 2):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(parse_address(receiver.address)[1])
            channel = Channel(sock)
            channel.send(hello | {"size": claimed}, fds=(fd,))
            reply, _ = channel.recv()
            assert not reply["ok"] and "cannot map the sender's shared segment" in reply["error"], reply
            channel.close()
    finally:
        os.close(fd)
        receiver.close()


def _size_and_resident(address: int) -> tuple[int, int]:
    """(Size, Rss) in kB of the mapping of this process that starts at `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            fields = dict(entry.split(":", 1) for entry in lines[i + 1 : i + 8])
            return int(fields["Size"].split()[0]), int(fields["Rss"].split()[0])
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_the_caches_are_backed_before_the_engine_writes_them(tmp_path):
    """Every page of the segment is resident once the caches exist, as torch.zeros leaves plain caches: left
    to first touch, the kernel allocates and clears each page inside the attention kernels mid-run."""
    connector = ShmConnector(config(tmp_path))
    try:
        caches = make_caches(LAYOUT, None, allocator=connector.kv_allocator())
        size, resident = _size_and_resident(caches[0].data_ptr())  # layer 0 opens the segment
        assert size >= LAYOUT.num_layers * 2 * LAYOUT.num_blocks * LAYOUT.block_nbytes // 1024
        assert resident == size
        assert all(int(c.count_nonzero()) == 0 for c in caches)  # still the zeros a fresh cache holds
    finally:
        connector.close()


# ------------------------------------------------------------------------------------- other users


_OTHER_UID = 65534  # nobody
_CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("refused")
    sys.exit(0)
s.settimeout(5)
print("closed" if s.recv(1) == b"" else "answered")
"""


def _as_other_user(path: str) -> str:
    import shutil
    import subprocess

    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.getuid() != 0 or python is None:
        pytest.skip("needs root (to run a client as another user) and a system python3")
    out = subprocess.run([python, "-c", _CONNECT, path], user=_OTHER_UID, group=_OTHER_UID, extra_groups=[],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_another_user_cannot_reach_the_kv_control_socket(tmp_path):
    folder = Path("/dev/shm") / f"kvrelay-test-{os.getpid()}-{tmp_path.name}"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)  # the folder lets anyone in: the socket itself must keep them out
    connector = ShmConnector(config(folder))
    try:
        _, path = parse_address(connector.address)
        path = str(path)
        assert (os.stat(path).st_mode & 0o777) == 0o600
        assert _as_other_user(path) == "refused"
        os.chmod(path, 0o666)  # even with the mode opened up, the receiver checks who connects
        assert _as_other_user(path) == "closed"
    finally:
        connector.close()
        folder.rmdir()


def test_a_transfer_names_its_blocks_once_on_a_connection(tmp_path):
    """Every layer of a transfer moves the same blocks: the first message names them, the later ones only their
    layers (the receiver checks the lists once), several to a message; a layer of a transfer whose blocks were
    never named is refused, and acks come in one message per batch of layers."""
    import socket

    from kvrelay.kv_transfer._shm_io import Channel

    receiver, sender = ShmConnector(config(tmp_path)), ShmConnector(config(tmp_path))
    try:
        for c in (receiver, sender):
            c.register_kv_caches(LAYOUT, make_caches(LAYOUT, None, allocator=c.kv_allocator()))
        receiver.expect("t", DST)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(parse_address(receiver.address)[1])
        channel = Channel(sock)
        hello, fds = sender._intro.message(None)
        channel.send(hello, fds=fds)
        assert channel.recv()[0]["ok"]
        channel.send({"k": "layers", "t": "t", "ls": [0], "s": SRC, "d": DST})
        acks = channel.recv()[0]["a"]
        channel.send({"k": "layers", "t": "t", "ls": [1, 2, 3]})  # several layers in one message
        acks += channel.recv()[0]["a"]
        assert acks == [["t", layer, 2 * len(SRC) * LAYOUT.block_nbytes, None] for layer in range(4)]
        assert receiver.wait_received("t", 5).nbytes == 4 * 2 * len(SRC) * LAYOUT.block_nbytes
        receiver.expect("u", DST)
        channel.send({"k": "layers", "t": "u", "ls": [0]})
        (_, _, nbytes, refusal), = channel.recv()[0]["a"]
        assert nbytes == 0 and "none named" in refusal
        with pytest.raises(TransferError, match="none named"):
            receiver.wait_received("u", 5)
        channel.close()
    finally:
        sender.close()
        receiver.close()
