"""Engine configuration: one frozen record per concern, grouped in EngineConfig.

Constructors across the engine take these objects instead of long argument lists.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvrelay.common.hashing import DEFAULT_BLOCK_SIZE, kv_dtype_key

if TYPE_CHECKING:  # torch is imported lazily: `kvrelay --help` should not pay for it
    import torch

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3  # bytes, CPU


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    SJF = "sjf"  # shortest prompt first, with aging


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


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for --kv-cache-dtype (common.hashing.KV_CACHE_DTYPES): fp8 is e4m3 with the scale 1.0
    vLLM uses when a checkpoint brings none (half a bf16 cache, a quarter of fp32); int8 the same size, its rows'
    values carrying their scales (kvrelay.engine.attention.base.quantize_int8)."""
    import torch

    return {"": model_dtype, "int8": torch.int8}.get(kv_dtype_key(name), torch.float8_e4m3fn)


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
    attention_backend: str = "auto"  # auto | torch | triton | flash_attn
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (kvrelay.engine.cuda_graphs)
    quantization: str | None = None  # gguf: keep a GGUF's quantized tensors in their blocks (models/gguf_blocks.py)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes (None: DEFAULT_KV_CACHE_MEMORY on CPU, gpu_memory_utilization on CUDA)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total device memory for weights + KV
    num_gpu_blocks_override: int | None = None  # tests: exact block count
    cache_salt: str = ""
    kv_cache_dtype: str = "auto"  # common.hashing.KV_CACHE_DTYPES
    # The offload tier every node of the host shares (kvrelay.engine.offload): shared memory, then disk.
    kv_offload_bytes: int = 0  # 0: no memory tier
    kv_offload_path: str = ""  # "": /dev/shm/kvrelay-kv-offload-<uid> (one per user: every node of it shares it)
    kv_offload_dir: str = ""  # "": no disk tier
    kv_offload_disk_bytes: int = 0

    def __post_init__(self) -> None:
        kv_dtype_key(self.kv_cache_dtype)  # ValueError naming the choices
        if self.kv_offload_bytes < 0 or self.kv_offload_disk_bytes < 0:
            raise ValueError("kv_offload_bytes, kv_offload_disk_bytes: must be >= 0")
        if bool(self.kv_offload_dir) != bool(self.kv_offload_disk_bytes):
            raise ValueError(f"kv_offload_dir: a disk tier needs its folder and its size (kv_offload_disk_bytes); "
                             f"got {self.kv_offload_dir!r} and {self.kv_offload_disk_bytes}")

    @property
    def offloads(self) -> bool:
        return bool(self.kv_offload_bytes or self.kv_offload_disk_bytes) and self.enable_prefix_caching


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # sjf: a second of waiting is worth this many prompt tokens (no request waits behind later arrivals for
    # longer than its prompt length / this).
    sjf_tokens_per_s: float = 1000.0
    enable_chunked_prefill: bool = True
    # A long prompt takes at most this many tokens of one step, so decodes keep flowing.
    long_prefill_token_threshold: int = 0  # 0: no cap beyond the budget
    # On a model that generates, pooling requests (embeddings, scores: batch work) take at most this many tokens
    # of a step, so a chat never waits long behind a step of them (a step runs to its end once started), and
    # none while a chat's prompt is computing (for at most 8 steps in a row: engine/scheduler.py).
    max_pooling_tokens_per_step: int = 64  # 0: no cap
    # Policies other than fcfs: a prompt this far behind (a priority value this much higher than) the most urgent
    # prompt of a step waits for the next step instead of lengthening this one, so an urgent request's first
    # token is not held by a batch of prompts it outranks (gateway.admission: a tenant's requests in flight).
    priority_step_gap: int = 8  # 0: prompts of any priority share a step
    # Disaggregation: how long a reservation or blocks held for a transfer live unclaimed.
    kv_lease_s: float = 30.0
    # Requests (and queued reservations) that may wait for room; past it new ones are refused (QueueFull).
    max_waiting_requests: int = 0  # 0: no bound
    # Admit a waiting request only if the blocks it takes leave what the running ones still need for their
    # prompts plus one block each; off: admit while blocks are free and preempt (recompute) later, as vLLM.
    admission_headroom: bool = True


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, configured with vLLM's keys (`--speculative-config '{"method": "ngram", ...}'`).

    ngram: prompt lookup over the request's own tokens, the continuation of the latest match of its last
    n tokens (n from prompt_lookup_max down to prompt_lookup_min). draft_model: `model` (same vocabulary)
    proposes autoregressively from its own paged KV cache."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # draft_model: folder, .gguf or "default"
    dtype: str | None = None  # draft_model: None = the target's
    # No new drafts while this many requests run (verification's extra rows cost more than they save in
    # large batches on CPU). Seeded draft-model output then depends on the load; n-gram output never does.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not one of {', '.join(SPEC_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 32:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer in [1, 32], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"speculative_config.prompt_lookup_min/max: need 1 <= min <= max, got {lo}, {hi}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: method 'draft_model' needs the draft model")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model: method 'ngram' uses no model")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"speculative_config.disable_by_batch_size: must be >= 1, got {self.disable_by_batch_size}")

    @property
    def lookahead_tokens(self) -> int:
        """KV slots past the verified tokens a proposer writes while proposing (a draft model's own KV)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, data: dict | SpeculativeConfig | str | None) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text); unknown keys are an error naming them. None/{}: off."""
        if data is None or isinstance(data, SpeculativeConfig):
            return data
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"speculative_config: expected a JSON object, got {type(data).__name__}")
        if not data:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        values = dict(data)
        if "method" not in values:  # vLLM: a model without a method means a draft model
            values["method"] = "draft_model" if values.get("model") else "ngram"
        return cls(**values)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar-constrained decoding: which grammar engine, and how compiled grammars are kept."""

    structured_outputs_backend: str = "xgrammar"
    grammar_compile_threads: int = 1  # compiles run on these threads, never on the engine step's
    grammar_cache_size: int = 256  # compiled grammars kept (least recently used go first)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters, with vLLM's flags: `max_loras` adapters run in one step (each in a slot of the model),
    `max_cpu_loras` are kept in memory (least recently used go first, and are read again from their files when
    asked for), ranks up to `max_lora_rank`. `lora_modules`: (name, path) pairs loaded at start."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: {self.max_cpu_loras} is less than max_loras {self.max_loras}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules: adapters need enable_lora")
        names = [name for name, _ in self.lora_modules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"lora_modules: adapter names given twice: {dup}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None

    def with_kwargs(self, **kwargs) -> EngineConfig:
        """This config with vLLM-style keyword arguments (a field of any group by its name, `speculative_config`
        as vLLM takes it) set over it; an unknown name is an error."""
        groups = {name: getattr(self, name) for name in _GROUPS}
        values: dict[str, dict] = {name: {} for name in _GROUPS}
        speculative = (SpeculativeConfig.from_dict(kwargs.pop("speculative_config"))
                       if "speculative_config" in kwargs else self.speculative)
        for key, value in kwargs.items():
            group = next((g for g, cfg in groups.items() if key in {f.name for f in dataclasses.fields(cfg)}), None)
            if group is None:
                raise TypeError(f"LLM: unknown argument {key!r}")
            if key == "policy":
                value = SchedulingPolicy(value)
            elif key == "lora_modules":
                value = parse_lora_modules(value)
            values[group][key] = value
        return EngineConfig(**{g: dataclasses.replace(cfg, **values[g]) for g, cfg in groups.items()},
                            speculative=speculative)


_GROUPS = ("model", "cache", "scheduler", "structured", "lora")


def parse_lora_modules(modules) -> tuple[tuple[str, str], ...]:
    """vLLM's --lora-modules forms: 'name=path', a JSON object {"name": ..., "path": ...}, a dict name -> path,
    or (name, path) pairs; as (name, path) pairs."""
    if isinstance(modules, dict):
        modules = list(modules.items())
    out = []
    for item in modules or ():
        if isinstance(item, str):
            text = item.strip()
            if text.startswith("{"):
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"lora_modules: {item!r} is not valid JSON ({e})") from None
                item = (data.get("name", ""), data.get("path", ""))
            else:
                name, sep, path = text.partition("=")
                if not sep:
                    raise ValueError(f"lora_modules: {item!r} is not name=path")
                item = (name, path)
        name, path = (str(v).strip() for v in item)
        if not name or not path:
            raise ValueError(f"lora_modules: {item!r} needs both a name and a path")
        out.append((name, path))
    return tuple(out)


def engine_config_from_kwargs(model: str, dtype: str, **kwargs) -> EngineConfig:
    """Map vLLM-style keyword arguments onto the config records; unknown names are an error."""
    return EngineConfig().with_kwargs(model=model, dtype=dtype, **kwargs)
