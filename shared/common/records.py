"""Records that several layers exchange: one definition each, no behaviour beyond describing themselves.

- `KVLayout`: the shape and dtype of a node's paged KV cache (engine, KV transfer, RPCs, registry).
- `NodeLoad`: a node's load as the engine counts it, GetLoad and the registry heartbeat report it, and the
  gateway routes by it.
- `TokenLogprobs`: one sampled token's logprobs, from the sampler to the client.
- `BeamSequence`: one finished beam of a beam search, from the engine to the client.
- `BlockEvent`: a block stored in or evicted from a node's prefix cache, for the index.
- `ImageInput`: an image in a prompt, at its placeholder tokens (gateway, RPCs, engine).

Nothing here imports torch at module import time: the gateway and `kvrelay --help` load this module too.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field, fields
from typing import NamedTuple, TypeVar

BlockHash = bytes  # 16 bytes of xxh3-128 (kvrelay.common.hashing)

_R = TypeVar("_R", bound="JsonRecord")


@dataclass(frozen=True)
class ImageInput:
    """An image of a prompt: its encoded bytes (PNG, JPEG, ...), which fill the `length` placeholder tokens from
    position `offset`. `content_hash` (kvrelay.common.hashing.image_hash of the bytes) goes into the hashes of the
    KV blocks those positions fall in, so the same text with another image never shares them."""

    offset: int
    length: int
    data: bytes = field(repr=False)
    content_hash: bytes = b""

    @property
    def end(self) -> int:
        return self.offset + self.length


class JsonRecord:
    """Compact JSON for dataclass records stored in Redis."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls: type[_R], data: str | bytes) -> _R:
        raw = json.loads(data)
        # Fields added later by newer nodes must not break older readers.
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """One layer's cache: [2 (keys, values), num_blocks, block_size, num_kv_heads, head_size]."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KVLayout:
    """A node's KV cache layout. Two nodes may exchange KV only when every field but num_blocks agrees."""

    model_id: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    num_blocks: int  # allowed to differ between peers: only block ids cross the wire

    @classmethod
    def for_caches(cls, model_id: str, kv_caches: list) -> KVLayout:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_caches[0].shape
        dtype = str(kv_caches[0].dtype).removeprefix("torch.")
        return cls(model_id, dtype, block_size, len(kv_caches), num_kv_heads, head_size, num_blocks)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of keys (or of values) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_size * self.itemsize

    def transfer_nbytes(self, num_blocks: int, num_layers: int | None = None) -> int:
        """Bytes moved when `num_blocks` blocks of keys and values go over, for every layer by default."""
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * num_blocks * layers * self.block_nbytes

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def cache_shape(self) -> tuple[int, ...]:
        return kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def mismatches(self, other: KVLayout) -> dict[str, tuple[object, object]]:
        """Every field but num_blocks where the two differ: {field: (ours, theirs)}."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if f.name != "num_blocks" and getattr(self, f.name) != getattr(other, f.name)
        }

    @staticmethod
    def describe(mismatches: dict[str, tuple[object, object]], self_name: str, other_name: str) -> str:
        detail = "; ".join(f"{k}: {self_name}={a!r} {other_name}={b!r}" for k, (a, b) in mismatches.items())
        return f"KV layout mismatch ({detail})"


@dataclass(frozen=True)
class NodeLoad(JsonRecord):
    """A node's load. The engine counts it after every iteration; `ts` is set when it is published."""

    num_waiting: int = 0
    num_running: int = 0
    num_reserved: int = 0  # decode role: reservations waiting for their KV
    num_held: int = 0  # prefill role: finished requests whose blocks a transfer still reads
    queued_prefill_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    kv_cache_usage: float = 0.0
    ts: float = field(default=0.0)  # wall-clock time.time() of the measurement (0: not published)
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters the node holds (can run without reading a file anew)
    lora_resident: tuple[str, ...] = ()  # those in its memory now
    lora_paths: tuple[str, ...] = ()  # where each of lora_adapters was read from, in the same order
    lora_capacity: int = 0  # adapters it keeps in memory without evicting one (0: LoRA is off)
    # With an offload tier: what loading a prompt token from it costs, as a fraction of computing one, measured on
    # the node (0.0: not measured yet).
    kv_tier_token_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lora_adapters", "lora_resident", "lora_paths"):
            if not isinstance(getattr(self, name), tuple):  # JSON gives a list
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def busy(self) -> bool:
        return bool(self.num_waiting or self.num_running or self.num_reserved or self.num_held)

    @property
    def active_seqs(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token, under the raw model logits
    rank: int  # 1-based: 1 + the number of tokens with a strictly higher logprob
    top: tuple[tuple[int, float], ...] = ()  # the requested number of most likely (token_id, logprob)


@dataclass(frozen=True)
class BeamSequence:
    token_ids: tuple[int, ...]  # generated tokens (an end token that finished the beam included)
    cumulative_logprob: float  # sum of the tokens' logprobs
    score: float  # what beams are ranked by: cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (an end token) or "length"
    stop_reason: int | None = None  # the stop token id, when it is not the model's eos


class BlockEventKind(enum.Enum):
    STORED = "stored"
    EVICTED = "evicted"


class BlockEvent(NamedTuple):
    """A change for the index, in the order it happened (a hash can be evicted and stored again). A named
    tuple: a node makes one per block it fills or evicts (hundreds per prompt), and a tuple costs a third of
    a frozen dataclass."""

    kind: BlockEventKind
    block_hash: BlockHash
