"""KV-block hashing: the one function the gateway and every engine share (docs/architecture.md, "Block hash").

    h_0 = H(model_id, block_size, cache_salt[, kv_dtype])
    h_i = H(h_{i-1} || token ids of block i as little-endian int32 || extra keys)

H is xxh3-128, kept as 16 bytes. Only full blocks are hashed. The encoding of the root is fixed here:
the UTF-8 of model_id, a NUL, block_size as little-endian uint32, a NUL, the UTF-8 of cache_salt; then, for a
quantized KV cache only (--kv-cache-dtype), a NUL and the UTF-8 of its dtype ("fp8_e4m3"), so no node, tier or
index ever takes a block of one KV dtype for the same prefix in another.
The extra keys name the LoRA adapter a block was computed with (`lora_extra_keys`): empty for the base model,
so a block is shared within one adapter and never across adapters or with the base model. A block that holds
positions of an image (a vision-language prompt's placeholder tokens) adds, per such image in order, "img", a
NUL, the image's content hash (xxh3-128 of its bytes) and its first position as little-endian uint32
(`image_extra_keys`): the placeholder tokens are the same for every image, the hash is not.

The chain runs in one native call when kvrelay.common.native could be built (the gateway hashes every prompt,
and the Python loop with its list-to-int32 conversion is the slow part of a routing decision); `_hash_blocks_py`
is the portable path and the reference the native one is tested against.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from kvrelay.common import native
from kvrelay.common.records import BlockHash, ImageInput

# Tokens per KV block: one fleet-wide number (nodes announce theirs; the gateway refuses a node that differs).
DEFAULT_BLOCK_SIZE = 16

_U32 = struct.Struct("<I")

# --kv-cache-dtype (vLLM's names, and int8): auto keeps K/V in the model's dtype; fp8 and fp8_e4m3 store OCP e4m3
# bytes; int8 stores int8 values with an fp16 scale per 32 of them, in the lowest bits of 16 of them.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")


def kv_dtype_key(kv_cache_dtype: str) -> str:
    """What a block hash's root carries for --kv-cache-dtype: "" for auto (the model's dtype, as before the
    flag existed), else the canonical name of the quantized dtype (fp8 and fp8_e4m3 are one)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unknown {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return {"auto": "", "int8": "int8"}.get(kv_cache_dtype, "fp8_e4m3")


def root_hash(model_id: str, block_size: int, cache_salt: str = "", kv_dtype: str = "") -> BlockHash:
    payload = model_id.encode() + b"\x00" + _U32.pack(block_size) + b"\x00" + cache_salt.encode()
    if kv_dtype:
        payload += b"\x00" + kv_dtype.encode()
    return xxhash.xxh3_128_digest(payload)


def lora_extra_keys(lora_name: str) -> bytes:
    """The extra keys of every block computed with adapter `lora_name` ("": the base model, no extra keys):
    "lora", a NUL, the UTF-8 of the name. After the block's fixed-length token bytes, so never ambiguous."""
    return b"lora\x00" + lora_name.encode() if lora_name else b""


def image_hash(data: bytes) -> bytes:
    """An image's content hash: xxh3-128 of its encoded bytes, the same in the gateway and every node."""
    return xxhash.xxh3_128_digest(data)


def image_extra_keys(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """The extra keys for the images with positions in [start, end) (a block's), in prompt order."""
    return b"".join(b"img\x00" + im.content_hash + _U32.pack(im.offset) for im in images
                    if im.offset < end and start < im.offset + im.length)


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    tokens = np.asarray(token_ids, dtype="<i4").tobytes()
    return xxhash.xxh3_128_digest(parent + tokens + extra_keys)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash,
    start_block: int = 0,
    extra_keys: bytes = b"",
    images: Sequence[ImageInput] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on, chained from `parent`
    (the hash of block start_block-1, or the root hash when start_block is 0). `images`: the prompt's images,
    whose blocks carry their content hashes."""
    if images:  # per-block extra keys: the portable path (image prompts are few and short next to their images)
        hashes = []
        for b in range(start_block, len(token_ids) // block_size):
            lo = b * block_size
            parent = hash_block(parent, token_ids[lo : lo + block_size],
                                extra_keys + image_extra_keys(images, lo, lo + block_size))
            hashes.append(parent)
        return hashes
    lib = native.load()
    if lib is None:
        return _hash_blocks_py(token_ids, block_size, parent, start_block, extra_keys)
    if not isinstance(token_ids, (list, tuple)):  # arrays and other sequences: as int32 bytes, in one go
        token_ids = np.asarray(token_ids, dtype="<i4").tobytes()
    return lib.hash_chain(token_ids, block_size, bytes(parent), start_block, bytes(extra_keys))


def _hash_blocks_py(
    token_ids: Sequence[int], block_size: int, parent: BlockHash, start_block: int = 0, extra_keys: bytes = b""
) -> list[BlockHash]:
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return []
    # One conversion for the whole prompt: per-block numpy calls dominate for long prompts.
    arr = np.asarray(token_ids[start_block * block_size : num_full * block_size], dtype="<i4")
    raw = arr.tobytes()
    stride = block_size * 4
    hashes: list[BlockHash] = []
    digest = xxhash.xxh3_128_digest
    for i in range(num_full - start_block):
        parent = digest(parent + raw[i * stride : (i + 1) * stride] + extra_keys)
        hashes.append(parent)
    return hashes


def prompt_block_hashes(
    token_ids: Sequence[int], model_id: str, block_size: int, cache_salt: str = "", lora_name: str = "",
    kv_dtype: str = "", images: Sequence[ImageInput] = (),
) -> list[BlockHash]:
    """All full-block hashes of a prompt, the way the gateway computes them for routing (`lora_name`: the
    adapter the request runs with, "" for the base model; `kv_dtype`: the nodes' quantized KV dtype, "" for
    none; `images`: its images)."""
    return hash_blocks(token_ids, block_size, root_hash(model_id, block_size, cache_salt, kv_dtype), 0,
                       lora_extra_keys(lora_name), images)
