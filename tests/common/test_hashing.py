"""KV-block hash contract (docs/architecture.md, "Block hash"): encoding, chaining, full blocks only, stability."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from kvrelay.common.hashing import hash_block, hash_blocks, kv_dtype_key, prompt_block_hashes, root_hash

REPO = Path(__file__).resolve().parents[2]


def _ref_root(model_id: str, block_size: int, salt: str) -> bytes:
    """Independent re-implementation of the documented root encoding."""
    payload = model_id.encode("utf-8") + b"\x00" + struct.pack("<I", block_size) + b"\x00" + salt.encode("utf-8")
    return xxhash.xxh3_128(payload).digest()


def _ref_chain(tokens: list[int], model_id: str, block_size: int, salt: str = "", extra: bytes = b"") -> list[bytes]:
    parent = _ref_root(model_id, block_size, salt)
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = xxhash.xxh3_128(parent + struct.pack(f"<{block_size}i", *block) + extra).digest()
        out.append(parent)
    return out


# -- root ----------------------------------------------------------------------------------------------


def test_root_hash_encoding():
    expected_payload = b"org/model\x00" + bytes([16, 0, 0, 0]) + b"\x00" + b"tenant-a"
    assert root_hash("org/model", 16, "tenant-a") == xxhash.xxh3_128_digest(expected_payload)
    # Empty salt: the payload ends with the second NUL.
    assert root_hash("m", 256) == xxhash.xxh3_128_digest(b"m\x00\x00\x01\x00\x00\x00")
    # Non-ASCII model ids and salts are encoded as UTF-8.
    assert root_hash("modèle", 32, "sél") == _ref_root("modèle", 32, "sél")


def test_root_hash_is_16_bytes():
    h = root_hash("m", 16)
    assert isinstance(h, bytes) and len(h) == 16


@pytest.mark.parametrize(
    "a, b",
    [
        (("m", 16, ""), ("m", 16, "salt")),
        (("m", 16, "s1"), ("m", 16, "s2")),
        (("m", 16, ""), ("n", 16, "")),
        (("m", 16, ""), ("m", 32, "")),
        (("m", 16, ""), ("m", 16 + 2**8, "")),  # block_size is a full uint32, not one byte
    ],
)
def test_root_hash_distinguishes_model_block_size_salt(a, b):
    assert root_hash(*a) != root_hash(*b)


def test_a_quantized_kv_cache_hashes_apart():
    """--kv-cache-dtype fp8: a NUL and the canonical dtype name end the root; auto leaves it as it was."""
    assert [kv_dtype_key(n) for n in ("auto", "fp8", "fp8_e4m3")] == ["", "fp8_e4m3", "fp8_e4m3"]
    with pytest.raises(ValueError, match="unknown 'int4'; choose one of auto, fp8, fp8_e4m3"):
        kv_dtype_key("int4")
    assert root_hash("m", 16, "s", "") == root_hash("m", 16, "s")
    fp8 = root_hash("m", 16, "s", "fp8_e4m3")
    assert fp8 == xxhash.xxh3_128_digest(b"m\x00\x10\x00\x00\x00\x00s\x00fp8_e4m3")
    tokens = list(range(40))
    assert prompt_block_hashes(tokens, "m", 16, "s", kv_dtype="fp8_e4m3") == hash_blocks(tokens, 16, fp8)
    assert set(prompt_block_hashes(tokens, "m", 16, "s", kv_dtype="fp8_e4m3")).isdisjoint(
        prompt_block_hashes(tokens, "m", 16, "s"))


# -- blocks --------------------------------------------------------------------------------------------


def test_hash_block_encoding_little_endian_int32():
    parent = bytes(range(16))
    tokens = [0, 1, 255, 256, 2**31 - 1, 70000]
    payload = parent + b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)
    assert hash_block(parent, tokens) == xxhash.xxh3_128_digest(payload)
    extra = b"\x07extra"
    assert hash_block(parent, tokens, extra) == xxhash.xxh3_128_digest(payload + extra)
    assert len(hash_block(parent, tokens)) == 16


def test_golden_values():
    """Pinned bytes: any change to the encoding (root, token width, endianness, chaining) breaks routing
    between gateways and engines of different versions, so it must fail here."""
    tokens = list(range(1, 41))  # 2 full blocks of 16, 8 tokens left over
    root = xxhash.xxh3_128(b"HuggingFaceTB/SmolLM2-135M-Instruct\x00\x10\x00\x00\x00\x00").digest()
    h0 = xxhash.xxh3_128(root + struct.pack("<16i", *range(1, 17))).digest()
    h1 = xxhash.xxh3_128(h0 + struct.pack("<16i", *range(17, 33))).digest()
    got = prompt_block_hashes(tokens, "HuggingFaceTB/SmolLM2-135M-Instruct", 16)
    assert got == [h0, h1]
    # Literal values too, so that a change in the xxhash package's output would also show.
    assert root.hex() == _GOLDEN_ROOT
    assert [h.hex() for h in got] == _GOLDEN_BLOCKS


_GOLDEN_ROOT = "e6b64e7062903b00942c519489747ea1"
_GOLDEN_BLOCKS = ["1d078725459c3619231a6441ec538566", "b7c72bfe8ad3c121b51396f5ddc53316"]


def test_only_full_blocks_are_hashed():
    bs = 4
    parent = root_hash("m", bs)
    assert hash_blocks([], bs, parent) == []
    assert hash_blocks([1, 2, 3], bs, parent) == []
    assert len(hash_blocks([1, 2, 3, 4], bs, parent)) == 1
    assert len(hash_blocks(list(range(11)), bs, parent)) == 2
    assert len(hash_blocks(list(range(12)), bs, parent)) == 3
    # The partial tail does not influence the full blocks' hashes.
    assert hash_blocks(list(range(8)) + [99, 98], bs, parent) == hash_blocks(list(range(8)), bs, parent)


def test_chaining_matches_reference_and_depends_on_all_previous_blocks():
    bs = 4
    tokens = list(range(100, 120))  # 5 blocks
    hashes = prompt_block_hashes(tokens, "m", bs)
    assert hashes == _ref_chain(tokens, "m", bs)
    assert all(len(h) == 16 for h in hashes)
    assert len(set(hashes)) == 5
    # Changing one token in block j changes h_j and every later hash, and none before.
    for j in range(5):
        changed = list(tokens)
        changed[j * bs + 1] += 1000
        other = prompt_block_hashes(changed, "m", bs)
        assert other[:j] == hashes[:j]
        assert all(other[i] != hashes[i] for i in range(j, 5))
    # Same block content in a different position (different parent) hashes differently.
    repeated = [7] * (3 * bs)
    rh = prompt_block_hashes(repeated, "m", bs)
    assert len(set(rh)) == 3
    # h_i is hash_block of h_{i-1}.
    parent = root_hash("m", bs)
    for i, h in enumerate(hashes):
        assert hash_block(parent, tokens[i * bs : (i + 1) * bs]) == h
        parent = h


def test_hash_blocks_from_start_block_equals_tail_of_full_computation():
    bs = 8
    tokens = [(i * 7919) % 50000 for i in range(8 * bs + 5)]
    full = prompt_block_hashes(tokens, "m", bs, "s")
    root = root_hash("m", bs, "s")
    assert hash_blocks(tokens, bs, root) == full
    assert hash_blocks(tokens, bs, root, start_block=0) == full
    for start in range(1, len(full) + 1):
        assert hash_blocks(tokens, bs, full[start - 1], start_block=start) == full[start:]
    # Past the last full block: nothing.
    assert hash_blocks(tokens, bs, full[-1], start_block=len(full) + 3) == []
    # Incremental extension as tokens arrive gives the same chain.
    acc: list[bytes] = []
    for n in range(len(tokens) + 1):
        acc += hash_blocks(tokens[:n], bs, acc[-1] if acc else root, start_block=len(acc))
    assert acc == full


def test_extra_keys_change_every_hash():
    bs = 4
    tokens = list(range(12))
    root = root_hash("m", bs)
    plain = hash_blocks(tokens, bs, root)
    extra = hash_blocks(tokens, bs, root, extra_keys=b"lora:1")
    assert extra == _ref_chain(tokens, "m", bs, extra=b"lora:1")
    assert all(a != b for a, b in zip(plain, extra))


def test_different_salt_model_block_size_give_different_hashes():
    tokens = list(range(64))
    base = prompt_block_hashes(tokens, "m", 16)
    salted = prompt_block_hashes(tokens, "m", 16, cache_salt="tenant")
    other_model = prompt_block_hashes(tokens, "m2", 16)
    other_bs = prompt_block_hashes(tokens, "m", 32)
    assert len(base) == len(salted) == len(other_model) == 4 and len(other_bs) == 2
    every = base + salted + other_model + other_bs
    assert len(set(every)) == len(every)


def test_accepts_any_int_sequence():
    import numpy as np

    tokens = list(range(32))
    ref = prompt_block_hashes(tokens, "m", 16)
    assert prompt_block_hashes(tuple(tokens), "m", 16) == ref
    assert prompt_block_hashes(np.arange(32, dtype=np.int64), "m", 16) == ref
    assert hash_block(root_hash("m", 16), np.arange(16, dtype=np.int64)) == ref[0]


def test_same_hashes_in_another_process():
    """No Python hash() or per-process randomness: a fresh interpreter (with a different hash seed)
    computes the same bytes."""
    tokens = [5, 17, 2**20, 0, 31999] * 13
    code = (
        "import sys; from kvrelay.common.hashing import prompt_block_hashes;"
        f"print(','.join(h.hex() for h in prompt_block_hashes({tokens!r}, 'org/m', 16, 'salt')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    here = prompt_block_hashes(tokens, "org/m", 16, "salt")
    assert len(here) == 4
    assert out.split(",") == [h.hex() for h in here]


# -- the native chain (shared/common/native.py) ------------------------------------------------------------------


def test_native_chain_builds_where_a_compiler_exists():
    import shutil

    from kvrelay.common import native

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the portable path is in use (and is what the other tests check)")
    assert native.load() is not None


@pytest.mark.parametrize("bs", [1, 4, 16, 256])
def test_native_chain_equals_portable_path(bs):
    import random

    import numpy as np

    from kvrelay.common import native
    from kvrelay.common.hashing import _hash_blocks_py

    if native.load() is None:
        pytest.skip("native helpers not built here")
    rng = random.Random(bs)
    for n in (0, bs - 1, bs, 3 * bs + 1, 40 * bs):
        tokens = [rng.randrange(-(2**31), 2**31) for _ in range(n)]
        parent = rng.randbytes(16)
        for start in (0, 1, 2):
            for extra in (b"", b"lora:7"):
                ref = _hash_blocks_py(tokens, bs, parent, start, extra)
                assert hash_blocks(tokens, bs, parent, start, extra) == ref
                assert hash_blocks(tuple(tokens), bs, parent, start, extra) == ref
                assert hash_blocks(np.asarray(tokens, dtype=np.int64), bs, parent, start, extra) == ref


def test_native_chain_rejects_what_numpy_rejects():
    from kvrelay.common import native

    if native.load() is None:
        pytest.skip("native helpers not built here")
    with pytest.raises(OverflowError):
        hash_blocks([1, 2, 2**31, 4], 2, bytes(16))
    with pytest.raises(TypeError):
        hash_blocks([1, 2, "3", 4], 2, bytes(16))
