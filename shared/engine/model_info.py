"""What the engine needs to know about a model: before loading it (its id, dtype, device, limits: ModelInfo), and
before even that (its shape read from its config alone: ModelShape), so that a launcher refuses an impossible
configuration in a second instead of after the weights have loaded (check_engine_config).

The shape comes from the model's config.json: a folder's own, a GGUF's cached conversion, or, for a GGUF not
converted yet, its metadata (read through the `gguf` package, without converting). Nothing here imports torch
until a ModelInfo is built: `kvrelay up` and `kvrelay <node> --help` run the checks without paying for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.common.units import format_bytes
from kvrelay.engine.config import EngineConfig, ModelConfig, parse_dtype
from kvrelay.engine.offload import default_offload_path, held_bytes
from kvrelay.engine.quant_config import METHODS, QuantConfigError, effective_method
from kvrelay.model_files.resolve import resolve_model
from kvrelay.model_files.vision import text_config

if TYPE_CHECKING:
    import torch

# Without --max-model-len the engine caps the context at what its KV cache holds. Below this many tokens a chat
# template and a short answer no longer fit, so a KV cache must hold at least one sequence of
# min(the model's context, MIN_USEFUL_TOKENS) tokens (and one of max_model_len when that is given).
MIN_USEFUL_TOKENS = 256
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class ModelInfo:
    path: str  # HF-style folder
    model_id: str  # names the model in hashes, the registry and the API
    device: torch.device
    dtype: torch.dtype
    eos_token_id: int | None
    max_position_embeddings: int
    architecture: str
    # generation_config may list more end tokens than the one eos (Llama 3 instruct: <|eot_id|>); like vLLM,
    # the engine stops on them as stop tokens unless ignore_eos.
    extra_eos_token_ids: tuple[int, ...] = ()
    quantization: str | None = None  # how the weights are held (ModelConfig.quantization)
    gguf_path: str | None = None  # quantization "gguf": the file whose blocks the weights are


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        from kvrelay.engine.auto_dtype import auto_dtype

        return auto_dtype(device.type)
    dtype = parse_dtype(name)
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("dtype: float16 is not supported on CPU; use bfloat16 or float32")
    return dtype


def load_model_info(config: ModelConfig) -> ModelInfo:
    # Engines built without the CLI's preflight (LLM(...)) get the same errors.
    quantization = _check_quantization(config)
    resolved = resolve_model(config.model)
    with open(os.path.join(resolved.path, "config.json")) as f:
        hf = json.load(f)
    device = resolve_device(config.device)
    eos_ids = _eos_token_ids(resolved.path, text_config(hf))
    return ModelInfo(
        path=resolved.path,
        model_id=resolved.model_id,
        device=device,
        dtype=resolve_dtype(config.dtype, device),
        eos_token_id=eos_ids[0] if eos_ids else None,
        max_position_embeddings=int(text_config(hf).get("max_position_embeddings", 2048)),
        architecture=(hf.get("architectures") or ["?"])[0],
        extra_eos_token_ids=eos_ids[1:],
        quantization=quantization,
        gguf_path=str(resolved.gguf_path) if config.quantization == "gguf" else None,
    )


def _eos_token_ids(path: str, hf: dict) -> tuple[int, ...]:
    """The end tokens, generation_config's first; its list wins over config.json's."""
    gen_path = os.path.join(path, "generation_config.json")
    eos = hf.get("eos_token_id")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(int(t) for t in ids))


# ------------------------------------------------------------------------------------ before loading


class ConfigError(ValueError):
    """An engine setting no engine could run with; `field` names it (an EngineConfig field, as its flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model's config that bound its context and size its KV cache."""

    model_id: str
    context_length: int  # max_position_embeddings
    num_layers: int
    num_kv_heads: int
    head_size: int
    source: str  # where they were read

    @classmethod
    def from_hf_config(cls, hf: dict, model_id: str, source: str) -> ModelShape:
        hf = text_config(hf)  # a vision-language model's context and KV are its language model's
        heads = int(hf["num_attention_heads"])  # as the model code reads it (models/llama.py)
        return cls(model_id, int(hf.get("max_position_embeddings", 2048)), int(hf["num_hidden_layers"]),
                   int(hf.get("num_key_value_heads") or heads), int(hf.get("head_dim") or hf["hidden_size"] // heads),
                   source)

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * element_size


def read_model_shape(spec: str) -> ModelShape:
    """The shape of `--model` (folder, .gguf or 'default') without loading weights or converting a GGUF;
    ConfigError('model', ...) when there is no such model."""
    from kvrelay.model_files import resolve

    spec = os.fspath(spec or "").strip()
    try:
        if spec == resolve.DEFAULT_SPEC:
            gguf, model_id = resolve.default_gguf_path(), resolve.DEFAULT_MODEL_ID
        else:
            path = Path(spec).expanduser()
            if path.is_dir():
                config = path / "config.json"
                if not config.is_file():
                    raise ConfigError("model", f"{spec} has no config.json (an HF model folder has one)")
                return ModelShape.from_hf_config(json.loads(config.read_text()), path.resolve().name,
                                                 f"{config}")
            if not path.is_file():
                raise ConfigError("model", f"{spec} is no file or folder (give a model folder, a .gguf file, "
                                           "or 'default')")
            if path.suffix.lower() != ".gguf":
                raise ConfigError("model", f"{spec} is neither a .gguf file nor a model folder")
            gguf, model_id = path.resolve(), path.stem
        converted = resolve.converted_dir_for(gguf) / "config.json"
        if converted.is_file():
            return ModelShape.from_hf_config(json.loads(converted.read_text()), model_id, str(converted))
        from gguf import GGUFReader

        from kvrelay.model_files.gguf import build_config

        return ModelShape.from_hf_config(build_config(GGUFReader(gguf)), model_id, f"the metadata of {gguf}")
    except ConfigError:
        raise
    except resolve.ModelResolveError as e:
        raise ConfigError("model", str(e)) from None
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError("model", f"cannot read the config of {spec} ({e})") from None


def kv_element_size(dtype: str) -> int:
    """Bytes per KV element of `--dtype`; 'auto' counts bfloat16, the smaller of its two choices (the bound is
    then a lower one: the engine's own check at load time covers a float32 pick)."""
    if dtype == "auto":
        return 2
    try:
        return 4 if str(parse_dtype(dtype)) == "torch.float32" else 2
    except ValueError as e:
        raise ConfigError("dtype", str(e).removeprefix("dtype: ")) from None


def min_kv_cache_tokens(config: EngineConfig, shape: ModelShape) -> int:
    """Tokens the KV cache must hold (one sequence; see MIN_USEFUL_TOKENS), whole blocks."""
    tokens = config.model.max_model_len or min(shape.context_length, MIN_USEFUL_TOKENS)
    block = config.cache.block_size
    return -(-tokens // block) * block


def check_engine_config(config: EngineConfig, shape: ModelShape | None = None) -> ModelShape:
    """Raise ConfigError for a setting no engine could run with, from the config and the model's shape alone
    (read here unless given); returns the shape. What it checks: positive counts and sizes, the device, the
    quantization method against the model, a max_model_len within the model's context, a KV cache that holds
    one sequence, and offload tiers that fit where they are put."""
    m, c, s = config.model, config.cache, config.scheduler
    for field, value, least in (("block_size", c.block_size, 1), ("max_num_seqs", s.max_num_seqs, 1),
                                ("max_num_batched_tokens", s.max_num_batched_tokens, 1),
                                ("max_waiting_requests", s.max_waiting_requests, 0)):
        if value < least:
            raise ConfigError(field, f"{value} is below {least}")
    if not 0 < c.gpu_memory_utilization <= 1:
        raise ConfigError("gpu_memory_utilization", f"{c.gpu_memory_utilization:g} is not a fraction in (0, 1]")
    _check_quantization(m)
    _check_device(m.device)
    element = 1 if c.kv_cache_dtype != "auto" else kv_element_size(m.dtype)
    shape = shape or read_model_shape(m.model)
    if m.max_model_len is not None:
        if m.max_model_len < 2:
            raise ConfigError("max_model_len", f"{m.max_model_len} leaves no room for a prompt and a token")
        if m.max_model_len > shape.context_length:
            raise ConfigError("max_model_len", f"{m.max_model_len} exceeds {shape.model_id}'s context of "
                                               f"{shape.context_length} tokens (max_position_embeddings in "
                                               f"{shape.source})")
    if c.kv_cache_memory is not None:
        if c.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory", "must be positive")
        tokens = min_kv_cache_tokens(config, shape)
        need = tokens * shape.kv_bytes_per_token(element)
        if c.kv_cache_memory < need:
            why = "max_model_len" if m.max_model_len else f"the smallest useful context, {MIN_USEFUL_TOKENS} tokens"
            raise ConfigError("kv_cache_memory", f"{format_bytes(c.kv_cache_memory)} hold less than one sequence: "
                                                 f"{tokens} tokens ({why}) of {shape.model_id} take "
                                                 f"{format_bytes(need)} ({shape.kv_bytes_per_token(element)} bytes "
                                                 f"per token); give at least {-(-need // 2**20)}MiB")
    _check_offload(c)
    return shape


def _check_offload(c) -> None:
    """Each offload tier's folder must be one this user can make, on a filesystem with room for its bound (what
    the store holds already counts as room: it is the store's)."""
    for field, folder, bound in (("kv_offload_bytes", c.kv_offload_path or default_offload_path(), c.kv_offload_bytes),
                                 ("kv_offload_disk_bytes", c.kv_offload_dir, c.kv_offload_disk_bytes)):
        if not bound:
            continue
        existing = Path(folder)
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(field, f"its folder {folder} cannot be made or written by this user")
        room = shutil.disk_usage(existing).free + held_bytes(folder)
        if room < bound:
            raise ConfigError(field, f"{format_bytes(bound)}, but the filesystem of {folder} has "
                                     f"{format_bytes(room)} for it; give less, or another folder")


def _method(flag: str | None, hf: dict) -> str | None:
    try:
        return effective_method(flag, hf)
    except QuantConfigError as e:
        raise ConfigError("quantization", str(e)) from None


def _check_quantization(m: ModelConfig) -> str | None:
    """The method against the model, and the method the weights load with: a checkpoint folder's
    quantization_config is read (and must load) whether or not --quantization names it."""
    if m.quantization not in (None, *METHODS):
        raise ConfigError("quantization", f"unknown method {m.quantization!r} ({', '.join(METHODS)})")
    folder = Path(os.fspath(m.model)).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file():
        method = _method(m.quantization if m.quantization != "gguf" else None,
                         json.loads((folder / "config.json").read_text()))
        if m.quantization != "gguf":
            return method
    elif m.quantization not in (None, "gguf"):
        raise ConfigError("quantization", f"{m.quantization} loads a checkpoint folder whose config.json says so; "
                                          f"{m.model!r} is not one (a GGUF's blocks: --quantization gguf)")
    if m.quantization != "gguf":
        return None
    if m.model != "default" and not m.model.lower().endswith(".gguf"):
        raise ConfigError("quantization", f"gguf keeps a .gguf file's blocks; {m.model!r} is not one (give a .gguf "
                                          "file or 'default')")
    if m.device.startswith("cuda"):
        raise ConfigError("quantization", "gguf runs on CPU only (--device cpu)")
    return "gguf"


def _check_device(device: str) -> None:
    if not _DEVICE.fullmatch(device):
        raise ConfigError("device", f"{device!r} is not auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and _torch_cuda_version() is None:
        raise ConfigError("device", f"{device} needs CUDA, and this torch is a CPU build; use cpu or auto, or "
                                    "install a CUDA build of torch")


def _torch_cuda_version() -> str | None:
    """torch.version.cuda, read from the installed torch's version.py without importing torch ('' if unknown)."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^cuda\b[^=\n]*=\s*(.+)$", text, re.MULTILINE)
        if found:
            value = found.group(1).strip()
            return None if value == "None" else value.strip("'\"")
    return ""
