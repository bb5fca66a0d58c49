"""Which quantized checkpoint a model folder holds, read from its config.json's `quantization_config` (as vLLM
reads it), and checked before anything loads.

Methods (vLLM's `--quantization` names), each kept quantized in memory by models/quant_weights.py:
- awq: AutoAWQ's GEMM layout: 4-bit weights with a zero point per group of input channels;
- gptq: AutoGPTQ's layout, 4 or 8 bits, a zero point per group, optional act-order (`desc_act`, `g_idx`);
  `checkpoint_format` gptq (zeros stored minus one, AutoGPTQ's v1) or gptq_v2;
- fp8: e4m3 weights with a per-tensor or per-channel `weight_scale`, or per-block `weight_scale_inv`
  (`weight_block_size`), as llm-compressor / AutoFP8 and HF's fine-grained FP8 write them.

A method given on the command line must be the checkpoint's; without one, the checkpoint's applies.
"""

from __future__ import annotations

from dataclasses import dataclass

CHECKPOINT_METHODS = ("awq", "gptq", "fp8")
METHODS = ("gguf", *CHECKPOINT_METHODS)


class QuantConfigError(ValueError):
    """A quantization_config this engine cannot load: the message says which field and why."""


@dataclass(frozen=True)
class QuantSpec:
    method: str
    bits: int = 8
    group_size: int = -1  # input channels per scale; -1: one group over the whole row
    desc_act: bool = False  # gptq act-order: each input channel's group is g_idx[channel]
    zeros_minus_one: bool = False  # gptq v1 stores each zero point minus one
    weight_block_size: tuple[int, int] | None = None  # fp8 per-block scales: (output rows, input columns)
    modules_not_converted: tuple[str, ...] = ()  # module names kept dense (awq, fp8 `ignored_layers`)


def quant_spec(hf_config: dict) -> QuantSpec | None:
    """The checkpoint's quantization, or None for a dense one; QuantConfigError for one that cannot load."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise QuantConfigError(f"quantization_config: expected an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(q)
    if method == "gptq":
        return _gptq(q)
    if method == "fp8":
        return _fp8(q)
    raise QuantConfigError(f"quantization_config.quant_method: {method or 'missing'!r} is not one of "
                           f"{', '.join(CHECKPOINT_METHODS)}")


def effective_method(flag: str | None, hf_config: dict) -> str | None:
    """The method the engine loads with: the flag's, checked against the checkpoint, or the checkpoint's own."""
    spec = quant_spec(hf_config)
    if flag in CHECKPOINT_METHODS:
        if spec is None:
            raise QuantConfigError(f"{flag}: the checkpoint has no quantization_config (it is not a {flag} "
                                   "checkpoint); leave --quantization out to load its dense weights")
        if spec.method != flag:
            raise QuantConfigError(f"{flag}: the checkpoint is quantized with {spec.method}; give --quantization "
                                   f"{spec.method} or leave it out")
    elif flag is not None and spec is not None:
        raise QuantConfigError(f"{flag}: the checkpoint is already quantized with {spec.method}")
    return flag if flag is not None else (spec.method if spec else None)


def _int(q: dict, field: str, method: str) -> int:
    value = q.get(field)
    if not isinstance(value, int) or isinstance(value, bool):
        raise QuantConfigError(f"quantization_config.{field}: {method} needs an integer, got {value!r}")
    return value


def _group(q: dict, method: str, field: str) -> int:
    size = _int(q, field, method)
    if size != -1 and (size <= 0 or size % 8):
        raise QuantConfigError(f"quantization_config.{field}: {size} is neither -1 nor a positive multiple of 8")
    return size


def _awq(q: dict) -> QuantSpec:
    bits = _int(q, "bits" if "bits" in q else "w_bit", "awq")
    if bits != 4:
        raise QuantConfigError(f"quantization_config.bits: awq weights are 4-bit, got {bits}")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantConfigError(f"quantization_config.version: {version!r}; only AutoAWQ's gemm layout loads")
    if q.get("zero_point", True) is not True:
        raise QuantConfigError("quantization_config.zero_point: awq without zero points is not supported")
    size = _group(q, "awq", "group_size" if "group_size" in q else "q_group_size")
    return QuantSpec("awq", 4, size, modules_not_converted=tuple(q.get("modules_to_not_convert") or ()))


def _gptq(q: dict) -> QuantSpec:
    bits = _int(q, "bits", "gptq")
    if bits not in (4, 8):
        raise QuantConfigError(f"quantization_config.bits: gptq weights of 4 or 8 bits load, got {bits}")
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantConfigError(f"quantization_config.checkpoint_format: {fmt!r} is not gptq or gptq_v2")
    return QuantSpec("gptq", bits, _group(q, "gptq", "group_size"), bool(q.get("desc_act", False)),
                     zeros_minus_one=fmt == "gptq")


def _fp8(q: dict) -> QuantSpec:
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise QuantConfigError(f"quantization_config.fmt: {fmt!r}; fp8 weights load as e4m3")
    block = q.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list | tuple) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantConfigError(f"quantization_config.weight_block_size: {block!r} is not two positive integers")
        block = (block[0], block[1])
    return QuantSpec("fp8", 8, weight_block_size=block,
                     modules_not_converted=tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ()))
