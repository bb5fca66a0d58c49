import os
import platform
import resource
import socket
import subprocess
import sys

import pytest

from kvrelay.common.system import (
    TORCH_THP_ENV,
    _ephemeral_range,
    format_cores,
    free_port,
    huge_pages_on_request,
    parse_cores,
    thp_mode,
    usable_cores,
)


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_repeated():
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(p < low for p in ports)


def test_a_free_port_can_be_bound_while_the_kernel_hands_out_its_own():
    port = free_port()
    # Many kernel-assigned ports (what outgoing connections and port-0 listeners get) never include ours.
    taken = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            taken.append(s)
        assert port not in {s.getsockname()[1] for s in taken}
        with socket.socket() as ours:
            ours.bind(("127.0.0.1", port))
    finally:
        for s in taken:
            s.close()


_CHURN = """
import resource, sys
from kvrelay.common.system import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # one forward pass's worth of activations: three 8 MiB buffers, written, then freed
    bufs = [bytearray(8 << 20) for _ in range(3)]
    del bufs
step(); step()  # the first steps may fault: the heap grows to its working size
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_activations_are_reused_rather_than_faulted_back_in():
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True)
        return int(out.stdout)

    pages_per_step = 3 * (8 << 20) // resource.getpagesize()
    assert faults("default") > 3 * pages_per_step  # glibc's default returns the buffers to the kernel
    assert faults("keep") < pages_per_step // 10


_HEAP = """
from kvrelay.common.system import keep_freed_memory, release_freed_memory
assert keep_freed_memory()
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
bufs = [bytearray(1 << 20) for _ in range(64)]  # 64 MiB of 1 MiB chunks: on the heap, under the mmap threshold
del bufs  # freed, and kept: the heap's free top is below keep_freed_memory's trim threshold
kept = rss_mib()
assert release_freed_memory()
print(kept, rss_mib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_memory_the_heap_keeps_goes_back_to_the_kernel():
    out = subprocess.run([sys.executable, "-c", _HEAP], capture_output=True, text=True, check=True)
    kept, released = (int(x) for x in out.stdout.split())
    assert kept - released >= 48  # most of the 64 MiB freed was still held, and is given back


_THP_PROBE = """
import sys
from kvrelay.common.system import huge_pages_for_tensors
print(huge_pages_for_tensors())
import torch
t = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # a block far past torch's 2 MiB threshold
ptr, eligible = t.data_ptr(), None
with open("/proc/self/smaps") as f:
    inside = False
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= ptr < end
        elif inside and head == "THPeligible:":
            eligible = line.split()[1]
print(eligible)
"""


@pytest.mark.skipif(not huge_pages_on_request(), reason="transparent huge pages are off here")
def test_large_tensors_ask_for_huge_pages_unless_told_not_to():
    def probe(env: dict[str, str]) -> list[str]:
        out = subprocess.run([sys.executable, "-c", _THP_PROBE], capture_output=True, text=True, check=True,
                             env={k: v for k, v in os.environ.items() if k != TORCH_THP_ENV} | env)
        return out.stdout.split()

    assert probe({}) == ["True", "1"]  # the tensor's mapping may take huge pages
    took, eligible = probe({TORCH_THP_ENV: "0"})
    assert took == "False"
    if thp_mode() == "madvise":  # (with `always` every mapping may, asked or not)
        assert eligible == "0"


def test_core_lists_read_and_write_as_taskset_does():
    assert parse_cores("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cores("5, 1") == (1, 5)
    assert format_cores((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11" and format_cores((7,)) == "7"
    for bad in ("", "a", "3-1", "-2", "1-"):
        with pytest.raises(ValueError):
            parse_cores(bad)
    assert set(usable_cores()) <= set(range(os.cpu_count() or 1)) and usable_cores()
