"""How a model folder says its embeddings are pooled: sentence-transformers' `modules.json` and its pooling
module's `config.json` (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`), as
vLLM reads them; a folder without them is a decoder whose last token's state is its embedding (Qwen3-Embedding,
e5-mistral). A *ForSequenceClassification model is a cross-encoder: it scores, it does not embed. Also the hidden
size, the most dimensions an embedding has."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str  # "last", "mean", "cls" or "classify" (kvrelay.common.sampling_params.PoolingType)
    hidden_size: int
    num_labels: int = 0  # a sequence classifier's outputs (a cross-encoder: 1); 0: the model embeds


def pooling_config(model_dir: str | Path) -> PoolingConfig:
    folder = Path(model_dir)
    config = _json(folder / "config.json")
    hidden = int(config.get("hidden_size", 0))
    if any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ()):
        return PoolingConfig("classify", hidden, len(config.get("id2label") or {}) or 1)
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return PoolingConfig("last", hidden)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m.get("path", "") for m in modules if isinstance(m, dict)}
    mode = "last"
    if "Pooling" in kinds:
        pooling = _json(folder / kinds["Pooling"] / "config.json")
        mode = next((name for key, name in _MODES if pooling.get(key)), "last")
    return PoolingConfig(mode, hidden)


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
