"""Engine configuration: one frozen record per concern, grouped in EngineConfig.

Constructors across the engine take these objects instead of long argument lists.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: `kvrelay --help` should not pay for it
    import torch

DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3  # bytes, CPU


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    try:
        return getattr(torch, _DTYPES[name.lower()])
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r}; choose one of {sorted(set(_DTYPES))}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and how. `model` is a folder, a .gguf file or 'default'."""

    model: str = "default"
    dtype: str = "auto"  # auto: bfloat16 on CPU and CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    attention_backend: str = "auto"  # auto | torch | flash_attn


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; CPU budget (None: DEFAULT_KV_CACHE_MEMORY)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total device memory for weights + KV
    num_gpu_blocks_override: int | None = None  # tests: exact block count
    cache_salt: str = ""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    enable_chunked_prefill: bool = True
    # A long prompt takes at most this many tokens of one step, so decodes keep flowing.
    long_prefill_token_threshold: int = 0  # 0: no cap beyond the budget
    # Disaggregation: how long a reservation or blocks held for a transfer live unclaimed.
    kv_lease_s: float = 30.0
    # Requests (and queued reservations) that may wait for room; past it new ones are refused (QueueFull).
    max_waiting_requests: int = 0  # 0: no bound


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


def engine_config_from_kwargs(model: str, dtype: str, **kwargs) -> EngineConfig:
    """Map vLLM-style keyword arguments onto the config records; unknown names are an error."""
    groups = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
    values: dict[str, dict] = {"model": {"model": model, "dtype": dtype}, "cache": {}, "scheduler": {}}
    for key, value in kwargs.items():
        for group, cls in groups.items():
            if key in {f.name for f in dataclasses.fields(cls)}:
                values[group][key] = value
                break
        else:
            raise TypeError(f"LLM: unknown argument {key!r}")
    if "policy" in values["scheduler"]:
        values["scheduler"]["policy"] = SchedulingPolicy(values["scheduler"]["policy"])
    return EngineConfig(**{g: cls(**values[g]) for g, cls in groups.items()})
