"""`kvrelay up --fleet-file FILE`: the fleet's models in YAML, each with its engines and names.

    models:
      - model: /models/llama-3.2-1b          # a folder, a .gguf file, or 'default'
        served_model_name: [llama, chat]     # one name or a list (default: the model id)
        prefill: 1                           # engines of this model (default: the --prefill/--decode flags,
        decode: 2                            #   else chosen for the machine)
        dtype: bfloat16                      # default: --dtype
        lora_modules: [sql=/adapters/sql]    # adapters its nodes load at start (implies --enable-lora)
      - model: /models/qwen2.5-0.5b
        colocated: true

Every problem is one UsageError naming the file and the entry.
"""

from __future__ import annotations

from pathlib import Path

from kvrelay.cli.args import UsageError
from kvrelay.cli.up_config import FleetModel

_KEYS = {"model", "served_model_name", "prefill", "decode", "colocated", "dtype", "lora_modules"}


def read_fleet_file(path: str) -> tuple[FleetModel, ...]:
    import yaml  # transformers' own dependency: always installed

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{path}: cannot read it ({e})", "--fleet-file") from None
    entries = data.get("models") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{path}: needs a non-empty `models:` list", "--fleet-file")
    return tuple(_model(path, i, entry) for i, entry in enumerate(entries))


def _model(path: str, i: int, entry) -> FleetModel:
    where = f"{path}: models[{i}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("model"), str) or not entry["model"]:
        raise UsageError(f"{where} needs `model:` (a folder, a .gguf file or 'default')", "--fleet-file")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise UsageError(f"{where}: unknown keys {unknown} (known: {sorted(_KEYS)})", "--fleet-file")
    for key in ("prefill", "decode"):
        if key in entry and (not isinstance(entry[key], int) or entry[key] < 0):
            raise UsageError(f"{where}: {key} must be a whole number >= 0", "--fleet-file")
    return FleetModel(
        model=entry["model"], served_model_names=_strings(entry.get("served_model_name"), where),
        prefill=entry.get("prefill"), decode=entry.get("decode"), colocated=bool(entry.get("colocated", False)),
        dtype=entry.get("dtype"), lora_modules=_strings(entry.get("lora_modules"), where),
    )


def _strings(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) and v for v in items):
        raise UsageError(f"{where}: {value!r} should be a name or a list of names", "--fleet-file")
    return tuple(items)
