"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

The engine only loads HF folders (config.json + safetensors + tokenizer files), so a GGUF is
dequantized once to float32 and cached. Output layout matches what `save_pretrained` of a
`LlamaForCausalLM` would write, so transformers can load the folder too (tests rely on that).

Concurrency: prefill and decode nodes often start together on the same cache. The conversion
runs under an fcntl lock next to the target and is published with one atomic rename, so a
reader sees either no folder or a complete one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# Bump when the output changes (layout, config keys, tokenizer handling): it is part of the cache key.
CONVERTER_VERSION = "1"
MANIFEST_NAME = "kvrelay_gguf.json"
SUPPORTED_ARCHS = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# ---------------------------------------------------------------- public API


_FINGERPRINT_SAMPLE = 1 << 20


def gguf_fingerprint(gguf_path: str | os.PathLike) -> str:
    """Short hash of the size, the first and the last MiB, and the converter version.

    Cheap for a file of any size, and a property of the file's bytes, not of where or when it was installed:
    the same GGUF in two virtualenvs shares one conversion (an mtime-based key converted it again, ~0.5 GB, for
    every fresh install). The first MiB holds the header (metadata, tensor names, shapes and offsets)."""
    path = Path(gguf_path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}:{CONVERTER_VERSION}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_FINGERPRINT_SAMPLE))
        if size > _FINGERPRINT_SAMPLE:
            f.seek(max(size - _FINGERPRINT_SAMPLE, _FINGERPRINT_SAMPLE))
            digest.update(f.read())
    return digest.hexdigest()[:12]


def is_converted(out_dir: str | os.PathLike) -> bool:
    """True when `out_dir` is a finished conversion (the manifest is written last, before the rename)."""
    return (Path(out_dir) / MANIFEST_NAME).is_file()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Write an HF-style float32 folder for `gguf_path` at `out_dir` and return `out_dir`.

    Idempotent: if another process already produced `out_dir` from the same file, it is reused.
    """
    ensure_converted(gguf_path, out_dir, progress=progress)
    return Path(out_dir)


def ensure_converted(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> bool:
    """Like `convert_gguf`, but returns whether this call did the conversion (False: reused)."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.with_name(out_dir.name + ".lock")):
        if out_dir.exists():
            _check_existing(out_dir, gguf_path)
            logger.info("GGUF already converted at %s (reusing)", out_dir)
            return False
        _remove_stale_tmp_dirs(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            _convert_into(gguf_path, tmp, progress)
            _fsync_tree(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared between users
            os.rename(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True


# ---------------------------------------------------------------- locking and publishing


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    # The lock file is never deleted: unlinking a lock others may hold breaks mutual exclusion.
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Another process holds %s (converting); waiting for it to finish", lock_path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _check_existing(out_dir: Path, gguf_path: Path) -> None:
    # Never overwrite a folder we did not write, nor silently serve a conversion of another file.
    if not is_converted(out_dir):
        raise FileExistsError(
            f"{out_dir} exists and is not a GGUF conversion; remove it or pick another path"
        )
    manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
    if manifest.get("fingerprint") != gguf_fingerprint(gguf_path):
        raise FileExistsError(
            f"{out_dir} holds a conversion of {manifest.get('source')} (or an older converter); remove it"
        )


def _remove_stale_tmp_dirs(out_dir: Path) -> None:
    # Only the lock holder writes temp dirs, so any left over come from a crashed conversion.
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        logger.warning("Removing leftover partial conversion %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    # Without this a crash right after the rename could publish a folder with truncated files.
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# ---------------------------------------------------------------- conversion


def _convert_into(gguf_path: Path, dst: Path, progress: bool) -> None:
    start = time.perf_counter()
    logger.info("Converting %s to a float32 HF folder (one-time; later starts use the cache)", gguf_path.name)
    reader = GGUFReader(gguf_path)
    config = build_config(reader)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_weights(reader, config, dst / "model.safetensors", progress)
    _write_tokenizer(gguf_path, dst, config, _meta(reader, "tokenizer.chat_template"))
    _write_generation_config(config, dst)
    manifest = {
        "source": str(gguf_path),
        "fingerprint": gguf_fingerprint(gguf_path),
        "converter_version": CONVERTER_VERSION,
        "seconds": round(time.perf_counter() - start, 2),
    }
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("Converted %s in %.1f s", gguf_path.name, manifest["seconds"])


def _meta(reader: GGUFReader, key: str, default=None):
    """Scalar or string metadata value; arrays are not needed here and are slow to decode."""
    field = reader.get_field(key)
    if field is None:
        return default
    vtype = field.types[0]
    part = field.parts[field.data[0]]
    if vtype == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part.tolist()[0]
    # GGUF stores float32; the shortest float32 repr gives back e.g. 1e-05 instead of 9.99999974e-06.
    return float(str(np.float32(value))) if vtype == GGUFValueType.FLOAT32 else value


def build_config(reader: GGUFReader) -> dict:
    """HF LlamaConfig dict from GGUF metadata."""
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    _reject_rope_scaling(reader, arch)
    names = {t.name for t in reader.tensors}
    hidden = _meta(reader, f"{arch}.embedding_length")
    heads = _meta(reader, f"{arch}.attention.head_count")
    head_dim = _meta(reader, f"{arch}.attention.key_length", hidden // heads)
    if _meta(reader, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported for llama GGUFs")
    vocab = _meta(reader, f"{arch}.vocab_size") or len(reader.get_field("tokenizer.ggml.tokens").data)
    theta = _meta(reader, f"{arch}.rope.freq_base", 10000.0)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _meta(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _meta(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _meta(reader, f"{arch}.context_length"),
        "rms_norm_eps": _meta(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        # transformers>=5 reads rope_parameters; older readers (and our own model code) use rope_theta.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id"),
        "initializer_range": 0.02,
        "use_cache": True,
        # The weights' dtype; "dtype" is the transformers>=5 spelling, "torch_dtype" the older one.
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _reject_rope_scaling(reader: GGUFReader, arch: str) -> None:
    # Silently ignoring scaling would produce a model that degrades past the original context.
    scaling = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUFs with RoPE scaling (e.g. Llama 3.1 rope_freqs) are not supported yet")


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name for a llama GGUF tensor name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"unexpected tensor {gguf_name!r} in llama GGUF")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"


def unpermute_rotary_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter interleaves each head's two rotary halves (ggml rotates adjacent pairs),
    while HF's rotate_half pairs row i with row i + head_dim/2. Works on weights and biases.
    """
    half = weights.shape[0] // n_heads // 2
    return weights.reshape(n_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def permuted_heads(gguf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """The heads whose rows llama.cpp permuted in this tensor (Q's or K's), None for every other tensor."""
    if ".attn_q." in gguf_name:
        return num_heads
    if ".attn_k." in gguf_name:
        return num_kv_heads
    return None


def dequantized(tensor, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """A GGUF tensor as float32 in HF layout (Q and K rows unpermuted)."""
    weights = dequantize(tensor.data, tensor.tensor_type)
    heads = permuted_heads(tensor.name, num_heads, num_kv_heads)
    if heads is not None:
        weights = unpermute_rotary_rows(weights, heads)
    return np.ascontiguousarray(weights, dtype=np.float32)


def _write_weights(reader: GGUFReader, config: dict, path: Path, progress: bool) -> None:
    """Stream tensors into a safetensors file one at a time, so peak memory is one tensor, not the model."""
    tensors = list(reader.tensors)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        # GGUF lists dimensions fastest-first; numpy/torch order is the reverse.
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        nbytes = 4 * int(np.prod(shape))
        header[hf_tensor_name(tensor.name)] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors wants the data section 8-byte aligned
    bar = tqdm(tensors, desc="Dequantizing GGUF", unit="tensor", disable=not progress)
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for tensor in bar:
            array = dequantized(tensor, config["num_attention_heads"], config["num_key_value_heads"])
            if list(array.shape) != header[hf_tensor_name(tensor.name)]["shape"]:
                raise ValueError(
                    f"tensor {tensor.name}: dequantized shape {array.shape} does not match header"
                )
            fh.write(array.tobytes())
    logger.info("Wrote %d float32 tensors (%.0f MiB) to %s", len(tensors), offset / 2**20, path.name)


def _write_tokenizer(gguf_path: Path, dst: Path, config: dict, chat_template: str | None) -> None:
    from transformers import AutoTokenizer  # heavy import; only needed when converting

    logger.info("Building the tokenizer from the GGUF vocabulary")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if chat_template and not getattr(tokenizer, "chat_template", None):
        # Some transformers versions drop the template when converting; chat requests need it.
        tokenizer.chat_template = chat_template
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(str(dst))


def _write_generation_config(config: dict, dst: Path) -> None:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    gen = {key: config[key] for key in keys if config.get(key) is not None}
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
