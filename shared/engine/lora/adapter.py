"""Reading a LoRA adapter in the PEFT format: `adapter_config.json` + `adapter_model.safetensors`, from a folder,
a `file://` URL or an `http(s)://` URL the node can reach (the two files are read from it; nothing is fetched from
a hub by name).

An adapter is checked against the base model before anything of it is used, and every problem is a ValueError
(`AdapterError`) that names the adapter and what is wrong: a missing file, a PEFT type or option the engine does
not run (DoRA, biases, modules_to_save, fan_in_fan_out), a target module other than the Llama-family projections
(q, k, v, o, gate, up, down), a rank past --max-lora-rank or other than the config's, a shape that does not fit
the model, a lora_A without its lora_B. A node answers it with INVALID_ARGUMENT (the client's 400) and goes on
serving.

The weights are kept as PEFT computes them: y += (x A^T) B^T * scaling, with scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora) folded into B once here.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")
_FETCH_TIMEOUT_S = 30.0


class AdapterError(ValueError):
    """A malformed adapter, or one that does not fit the base model or the engine's limits."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: run a request with the adapter `lora_name` (read from `lora_path` if the engine does not know it
    yet). `lora_int_id` is kept for vLLM's callers; adapters are known by name."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass(frozen=True)
class ModuleShape:
    """One projection the adapters may target: its input size and output size, in one layer."""

    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    """An adapter's weights, ready to copy into a slot: (layer, module) -> (A [r, in], B [out, r] * scaling)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    read_seconds: float = 0.0  # how long reading and checking its files took

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def read_adapter(name: str, path: str, shapes: dict[str, ModuleShape], num_layers: int, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at `path`, checked against the model (`shapes`: per projection name) and `max_rank`."""
    if not name:
        raise AdapterError("lora_name: must not be empty")
    with _local_folder(name, path) as folder:
        config = _read_config(name, folder)
        rank, scaling = _rank_and_scaling(name, config, max_rank)
        weights = _read_weights(name, folder / WEIGHTS_FILE, shapes, num_layers, rank, scaling, dtype)
    return LoRAAdapter(name, path, rank, scaling, weights)


class _local_folder:
    """The adapter's folder: the path itself, or a temporary copy of the two files behind a URL."""

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Path:
        url = urllib.parse.urlparse(self.path)
        if url.scheme in ("http", "https"):
            self._tmp = tempfile.TemporaryDirectory(prefix="kvrelay-lora-")
            folder = Path(self._tmp.name)
            base = self.path.rstrip("/")
            for file in (CONFIG_FILE, WEIGHTS_FILE):
                try:
                    with urllib.request.urlopen(f"{base}/{file}", timeout=_FETCH_TIMEOUT_S) as resp:
                        (folder / file).write_bytes(resp.read())
                except OSError as e:
                    raise AdapterError(f"adapter {self.name!r}: cannot read {base}/{file} ({e})") from None
            return folder
        folder = Path(urllib.parse.unquote(url.path) if url.scheme == "file" else self.path).expanduser()
        if not folder.is_dir():
            raise AdapterError(f"adapter {self.name!r}: {self.path} is not a folder this node can read")
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            if not (folder / file).is_file():
                extra = " (only safetensors weights load)" if file == WEIGHTS_FILE and any(
                    folder.glob("adapter_model.bin")) else ""
                raise AdapterError(f"adapter {self.name!r}: no {file} in {folder}{extra}")
        return folder

    def __exit__(self, *exc) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def _read_config(name: str, folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {peft_type!r} is not LORA")
    refused = [(key, config.get(key)) for key in ("use_dora", "fan_in_fan_out") if config.get(key)]
    if config.get("bias", "none") not in ("none", None):
        refused.append(("bias", config["bias"]))
    if config.get("modules_to_save"):
        refused.append(("modules_to_save", config["modules_to_save"]))
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            refused.append((key, config[key]))
    if refused:
        detail = ", ".join(f"{k}={v!r}" for k, v in refused)
        raise AdapterError(f"adapter {name!r}: {detail} is not supported (plain LoRA on the projections only)")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a string is a regex over module names: the weights say what it matched)
        unsupported = [t for t in targets if t.rpartition(".")[2] not in SUPPORTED_MODULES]
        if unsupported:
            raise AdapterError(f"adapter {name!r}: targets {', '.join(map(repr, unsupported))}, which kvrelay does "
                               f"not run LoRA on (supported: {', '.join(SUPPORTED_MODULES)})")
    return config


def _rank_and_scaling(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} has no valid rank r ({rank!r})")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} exceeds this node's --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)):
        raise AdapterError(f"adapter {name!r}: lora_alpha {alpha!r} is not a number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_weights(name: str, file: Path, shapes: dict[str, ModuleShape], num_layers: int, rank: int,
                  scaling: float, dtype: torch.dtype) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                match = _KEY.match(key)
                if match is None:
                    module = _module_of(key)
                    raise AdapterError(f"adapter {name!r}: targets {module!r}, which kvrelay does not run LoRA on "
                                       f"(supported: {', '.join(SUPPORTED_MODULES)})")
                layer, module, half = int(match[1]), match[2], match[3]
                if module not in shapes:
                    raise AdapterError(f"adapter {name!r}: targets {module!r}, which kvrelay does not run LoRA on "
                                       f"(supported: {', '.join(SUPPORTED_MODULES)})")
                if layer >= num_layers:
                    raise AdapterError(f"adapter {name!r}: {key} is for layer {layer}; the model has {num_layers}")
                halves.setdefault((layer, module), {})[half] = f.get_tensor(key)
    except SafetensorError as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    if not halves:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {where} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        shape = shapes[module]
        if a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"adapter {name!r}: {where}: lora_A and lora_B must be matrices")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"adapter {name!r}: {where} has rank {a.shape[0]}/{b.shape[1]} (lora_A/lora_B) but "
                               f"{CONFIG_FILE} says r={rank}")
        if a.shape[1] != shape.in_features or b.shape[0] != shape.out_features:
            raise AdapterError(f"adapter {name!r}: {where} maps {a.shape[1]} -> {b.shape[0]} features; the model's "
                               f"{module} maps {shape.in_features} -> {shape.out_features}")
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return weights


def _module_of(key: str) -> str:
    """The module a weight's key belongs to: the part before its LoRA (or PEFT base layer) part."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if (part.startswith("lora_") or part == "base_layer") and i > 0:
            return parts[i - 1]
    return parts[-2] if len(parts) > 1 else key
