"""The engine's command-line flags (as vLLM's `EngineArgs`): the node commands, `kvrelay generate` and the
benchmarks that build engines all take the same flags with the same meanings, vLLM's names where vLLM has one.

The flags' defaults are read from an EngineConfig (kvrelay.engine.config): the engine's own by default, the one a
node serves with (kvrelay.node.config) for the node commands.
"""

from __future__ import annotations

import argparse

from kvrelay.common.hashing import KV_CACHE_DTYPES
from kvrelay.common.units import byte_size
from kvrelay.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    parse_lora_modules,
)
from kvrelay.engine.quant_config import METHODS as QUANTIZATION_METHODS

SCHEDULING_POLICIES = [p.value for p in SchedulingPolicy]

OFFLOAD_FIELDS = ("kv_offload_bytes", "kv_offload_path", "kv_offload_dir", "kv_offload_disk_bytes")
# The engine flags' destinations; each sets the engine field (and LLM(...) keyword) of its name, but these.
_ENGINE_FLAGS = ("device", "quantization", "max_model_len", "block_size", "kv_cache_memory", "kv_cache_dtype",
                 "gpu_memory_utilization", *OFFLOAD_FIELDS,
                 "max_num_batched_tokens", "max_num_seqs", "max_waiting_requests", "admission_headroom",
                 "max_pooling_tokens_per_step", "priority_step_gap",
                 "enable_prefix_caching", "scheduling_policy", "attention_backend", "enforce_eager",
                 "structured_outputs_backend",
                 "speculative_config", "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")
_KEYWORDS = {"scheduling_policy": "policy"}


def add_engine_args(p: argparse.ArgumentParser, defaults: EngineConfig | None = None) -> None:
    """The engine flags, their defaults from `defaults` (the engine's own when None: they suit offline runs, where
    everything arrives at once and fcfs keeps the caller's order, as vLLM does)."""
    d = defaults or EngineConfig()
    m, c, s = d.model, d.cache, d.scheduler
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=m.model,
                   help="HF-style model folder, a .gguf file, or 'default' (SmolLM2-135M-Instruct, converted once)")
    g.add_argument("--dtype", default=m.dtype,
                   help="auto (the faster of float32 and bfloat16 on this machine), bfloat16, float32; "
                        "float16 on CUDA only")
    g.add_argument("--device", default=m.device, help="auto (cuda when available), cpu, cuda, cuda:N")
    g.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS, default=m.quantization,
                   help="gguf: serve a .gguf model's Q4_0/Q4_1/Q8_0 tensors as the file stores them, on int8 "
                        "kernels as llama.cpp does (a quarter to an eighth of the weight memory; CPU only); other "
                        "types are dequantized at load. Default: dequantize the whole GGUF once, to --dtype. awq, "
                        "gptq, fp8: a checkpoint folder of that kind, kept quantized and dequantized per tile as it "
                        "computes (read from its config.json's quantization_config when not given)")
    g.add_argument("--max-model-len", type=int, default=m.max_model_len, help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block (fleet-wide)")
    g.add_argument("--kv-cache-memory", type=byte_size, default=c.kv_cache_memory,
                   help="KV cache size: bytes or with a unit, e.g. 512MiB, 4GiB (CPU default 2 GiB; on CUDA it "
                        "overrides --gpu-memory-utilization); the log says how many tokens fit")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=c.kv_cache_dtype,
                   help="auto: K/V in --dtype; fp8 (= fp8_e4m3): one byte a value, e4m3 with scale 1.0 as vLLM "
                        "uses without calibrated scales: twice the tokens of a bf16 cache in the same memory, "
                        "half the bytes per KV transfer; int8: the same size, an fp16 scale per 32 values kept "
                        "in their lowest bits, closer to bf16 (head size a multiple of 32). Every node of a fleet "
                        "and the gateway take the same (docs/quantization.md)")
    add_offload_args(g, c)
    g.add_argument("--gpu-memory-utilization", type=float, default=c.gpu_memory_utilization,
                   help="CUDA: fraction of device memory for weights plus KV cache")
    g.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens,
                   help="token budget of one engine step")
    g.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs, help="most requests running at once")
    g.add_argument("--max-pooling-tokens-per-step", type=int, default=s.max_pooling_tokens_per_step,
                   help="on a model that generates, the most tokens of a step pooling requests (embeddings, "
                        "scores) take, so a chat never waits long behind a step of them; while a chat's prompt "
                        "computes they take none, for up to 8 steps in a row (0: no cap; an encoder or "
                        "cross-encoder is never capped)")
    g.add_argument("--priority-step-gap", type=int, default=s.priority_step_gap,
                   help="policies priority and sjf: a prompt whose priority value is this much above the most "
                        "urgent prompt of a step waits for the next step instead of lengthening this one (the "
                        "gateway ranks a tenant's request by its tenant's requests in flight; 0: any prompts "
                        "share a step)")
    g.add_argument("--max-waiting-requests", type=int, default=s.max_waiting_requests,
                   help="requests (and queued decode reservations) that may wait for room; past it new ones are "
                        "refused, which the gateway answers with 429 (0: no bound)")
    g.add_argument("--admission-headroom", action=argparse.BooleanOptionalAction, default=s.admission_headroom,
                   help="admit a request only if the KV blocks it takes leave room for the running requests' "
                        "prompts and one block each to grow into (fewer preemptions, each of which recomputes)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=c.enable_prefix_caching,
                   help="reuse KV blocks of identical prompt prefixes")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=s.policy.value,
                   help="waiting order (fcfs; priority: by the request's priority, then arrival; sjf: the shortest "
                        f"prompt first, each second waited worth {s.sjf_tokens_per_s:g} prompt tokens, so a burst's "
                        "short prompts start decoding while long ones compute); with priority, the lowest priority "
                        "is preempted first when KV blocks run out")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton", "flash_attn"],
                   default=m.attention_backend,
                   help="auto: on CUDA triton (paged attention read in place; CUDA graphs for decode), else "
                        "flash-attn when installed; on CPU the torch backend with the native kernels")
    g.add_argument("--enforce-eager", action="store_true", default=m.enforce_eager,
                   help="CUDA: run every step eagerly (default: decode steps replay CUDA graphs captured at start for "
                        "batches of 1, 2, 4, 8, 16, ... up to --max-num-seqs rows, when the attention backend allows)")
    g.add_argument("--structured-outputs-backend", choices=["xgrammar"],
                   default=d.structured.structured_outputs_backend,
                   help="grammar engine of response_format / structured_outputs / tool_choice constraints")
    add_lora_args(g, d.lora)
    g.add_argument("--speculative-config", type=speculative_json, default=None,
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": "<folder>", '
                        '"num_speculative_tokens": 4}\' (default: off)')


def add_offload_args(g, c: CacheConfig) -> None:
    """The offload tier's flags (nodes, `kvrelay generate`, and `kvrelay up`, which hands them on), their defaults
    from `c` (a CacheConfig, or kvrelay up's config, whose None passes nothing on)."""
    g.add_argument("--kv-offload-bytes", type=byte_size, default=c.kv_offload_bytes, metavar="BYTES",
                   help="keep KV blocks evicted from the cache in a shared-memory store of this size that every node "
                        "of this host (this user's) shares, and load them back instead of recomputing a prompt's "
                        "prefix, e.g. 8GiB (default 0: off)")
    g.add_argument("--kv-offload-path", default=c.kv_offload_path, metavar="DIR",
                   help="the shared-memory store's folder (default /dev/shm/kvrelay-kv-offload-<uid>); nodes that "
                        "name the same folder share their blocks")
    g.add_argument("--kv-offload-dir", default=c.kv_offload_dir, metavar="DIR",
                   help="a disk tier under the shared-memory one: blocks it evicts go here (with "
                        "--kv-offload-disk-bytes)")
    g.add_argument("--kv-offload-disk-bytes", type=byte_size, default=c.kv_offload_disk_bytes, metavar="BYTES",
                   help="the disk tier's size, e.g. 100GiB")


def add_lora_args(g, lora: LoRAConfig) -> None:
    """vLLM's LoRA flags (nodes, `kvrelay generate`, and `kvrelay up`, which hands them on)."""
    g.add_argument("--enable-lora", action="store_true", default=lora.enable_lora,
                   help="serve LoRA adapters: a request names one in `model`; base-model requests and those of "
                        "different adapters run in one batch")
    g.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                   help="adapters to load at start, as name=path (a PEFT folder: adapter_config.json + "
                        "adapter_model.safetensors) or vLLM's JSON {\"name\": ..., \"path\": ...}")
    g.add_argument("--max-loras", type=int, default=lora.max_loras, help="distinct adapters in one batch")
    g.add_argument("--max-lora-rank", type=int, default=lora.max_lora_rank, help="the largest adapter rank taken")
    g.add_argument("--max-cpu-loras", type=int, default=lora.max_cpu_loras,
                   help="adapters kept in memory (default: --max-loras); the least recently used go first, and are "
                        "read from their files again when asked for")


def lora_module(text: str) -> str:
    """Checks one --lora-modules entry (argparse names the flag when it is bad) and keeps the text."""
    try:
        parse_lora_modules([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def speculative_json(text: str) -> str:
    """Checks the JSON (argparse reports a bad one with the flag's name) and keeps the text to pass on."""
    try:
        SpeculativeConfig.from_dict(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags as vLLM-style keyword arguments (what `LLM(...)` takes); a parser without one of them
    leaves that keyword out."""
    return {_KEYWORDS.get(dest, dest): getattr(args, dest) for dest in _ENGINE_FLAGS if hasattr(args, dest)}


def engine_config(args: argparse.Namespace, defaults: EngineConfig | None = None, **extra) -> EngineConfig:
    """The engine config of the flags, over `defaults` (what add_engine_args took the flags' defaults from);
    `extra`: fields without an engine flag (e.g. seed, kv_lease_s)."""
    return (defaults or EngineConfig()).with_kwargs(model=args.model, dtype=args.dtype, **engine_kwargs(args),
                                                    **extra)
