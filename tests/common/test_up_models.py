"""`kvrelay up` with several base models (repeated --model, or --fleet-file): each model's engines and names, the
cores split over every engine, the gateway told every model and name, and vLLM's LoRA flags handed to the nodes."""

import argparse
import json

import pytest

from kvrelay.cli import up
from kvrelay.cli.args import UsageError


def _config(*argv: str) -> up.UpConfig:
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    return up.config_from_args(parser.parse_args(["up", *argv]))


def _children(config: up.UpConfig) -> dict[str, list[str]]:
    return {c.name: c.argv for c in up.plan_children(config, "redis://127.0.0.1:1/0", up.placement(config))}


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_two_models_from_repeated_model_flags(monkeypatch):
    monkeypatch.setattr(up.os, "cpu_count", lambda: 2)
    config = _config("--model", "/m/llama", "--model", "/m/qwen", "--served-model-name", "chat", "small=/m/qwen",
                     "--enable-lora", "--max-loras", "4", "--lora-modules", "sql=/a/sql")
    children = _children(config)
    assert set(children) == {"colocated-0", "qwen-colocated-0", "gateway"}  # 2 cores: a colocated engine each
    assert _values(children["colocated-0"], "--model") == ["/m/llama"]
    assert _values(children["qwen-colocated-0"], "--model") == ["/m/qwen"]
    assert _values(children["qwen-colocated-0"], "--served-model-name") == ["small"]
    assert _values(children["colocated-0"], "--num-threads") == ["1"]  # 2 cores over 2 engines
    for node in ("colocated-0", "qwen-colocated-0"):
        argv = children[node]
        assert "--enable-lora" in argv and _values(argv, "--max-loras") == ["4"]
        assert argv[argv.index("--lora-modules") + 1] == "sql=/a/sql"
    gateway = children["gateway"]
    assert _values(gateway, "--model") == ["/m/llama", "/m/qwen"]
    names = gateway[gateway.index("--served-model-name") + 1:]
    assert names[:2] == ["chat", "small=/m/qwen"]


def test_a_fleet_file_gives_each_model_its_engines(tmp_path, monkeypatch):
    monkeypatch.setattr(up.os, "cpu_count", lambda: 8)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"models": [
        {"model": "/m/a", "served_model_name": ["a", "a2"], "prefill": 1, "decode": 1},
        {"model": "/m/b", "colocated": True, "decode": 2, "dtype": "bfloat16", "lora_modules": ["x=/a/x"]}]}))
    config = _config("--fleet-file", str(fleet))
    where = up.placement(config)
    assert where.layout() == "a: 1 prefill + 1 decode; b: colocated (2 engines)"
    children = _children(config)
    assert set(children) == {"prefill-0", "decode-0", "b-colocated-0", "b-colocated-1", "gateway"}
    assert _values(children["decode-0"], "--num-threads") == ["2"]  # 8 cores over 4 engines
    assert _values(children["b-colocated-1"], "--dtype") == ["bfloat16"]
    assert "--enable-lora" in children["b-colocated-0"] and "--enable-lora" not in children["decode-0"]
    gateway = children["gateway"]
    assert gateway[gateway.index("--served-model-name") + 1:][:2] == ["a", "a2"]


@pytest.mark.parametrize("text, message", [
    ("models: []", "non-empty `models:` list"),
    ("models: [{served_model_name: x}]", "needs `model:`"),
    ("models: [{model: /m/a, decode: -1}]", "decode must be a whole number"),
    ("models: [{model: /m/a, gpus: 2}]", "unknown keys ['gpus']"),
])
def test_a_bad_fleet_file_is_one_line_naming_the_entry(tmp_path, text, message):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(text)
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        _config("--fleet-file", str(fleet))
    assert err.value.flag == "--fleet-file"
    with pytest.raises(UsageError, match="not both"):
        _config("--fleet-file", str(fleet), "--model", "/m/a")
