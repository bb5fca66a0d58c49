"""The KV offload tier: blocks evicted from a node's KV cache kept in a store every node of the host shares
(shared memory, then disk), and loaded back instead of recomputed. `store` holds the files, `tier` the engine's
side; `create_offload` builds both from the cache config."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import xxhash

from kvrelay.common.records import KVLayout
from kvrelay.engine.config import CacheConfig
from kvrelay.engine.offload.store import DirTier, TieredStore, used_in
from kvrelay.engine.offload.tier import BlockIO, KVOffload

logger = logging.getLogger(__name__)


def default_offload_path() -> str:
    return f"/dev/shm/kvrelay-kv-offload-{os.getuid()}"


def held_bytes(folder: str) -> int:
    """What a tier's folder holds now (0 when there is none yet)."""
    return used_in(Path(folder))


_WEIGHT_FILES = (".safetensors", ".bin", ".gguf", ".json")


def namespace(layout: KVLayout, weights: list[str], block_bytes: int) -> str:
    """What a block's key starts with: the KV layout but its block count, the bytes of a block's payload (a draft
    model's KV included), and the weights' files as they are now (path, size, modification time), so weights
    changed under the same model name never meet old blocks."""
    h = xxhash.xxh3_64()
    files: list[Path] = []
    for name in weights:
        path = Path(name)
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_FILES)
        elif path.is_file():
            files.append(path)
        else:  # a name the engine resolves itself ("default")
            h.update(f"{name}\0".encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\0".encode())
    return (f"{layout.model_id}|{layout.dtype}|{layout.block_size}|{layout.num_layers}|{layout.num_kv_heads}|"
            f"{layout.head_size}|{block_bytes}|{h.hexdigest()}")


def create_offload(cache: CacheConfig, namespace: str, io: BlockIO, block_bytes: int) -> KVOffload | None:
    """The tier `cache` asks for (None: none), for blocks of `block_bytes` whose keys start with `namespace`."""
    if not cache.offloads:
        return None
    tiers = []
    if cache.kv_offload_bytes:
        tiers.append(DirTier("memory", cache.kv_offload_path or default_offload_path(), cache.kv_offload_bytes))
    if cache.kv_offload_disk_bytes:
        tiers.append(DirTier("disk", cache.kv_offload_dir, cache.kv_offload_disk_bytes))
    for tier in tiers:
        held = tier.used_bytes()
        logger.info("KV offload tier %s at %s: %.0f MiB, %.0f MiB held already (shared by every node of this host "
                    "that names the folder)", tier.name, tier.path, tier.capacity / 2**20, held / 2**20)
    return KVOffload(TieredStore(tiers), namespace, io, block_bytes, cache.block_size)
