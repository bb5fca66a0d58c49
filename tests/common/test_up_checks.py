"""`kvrelay up` (and the node and gateway commands) refuse what cannot run before starting anything: one line
`kvrelay <command>: error: ...` naming the flag, exit code 2. Run in-process here (the real `kvrelay up`
subprocesses, with their 3 s bound, are in tests/e2e/test_newcomer.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvrelay.cli import main, parse
from kvrelay.cli.args import UsageError
from kvrelay.cli.fleet import Fleet, FleetPorts
from kvrelay.cli.gateway import check_gateway
from kvrelay.cli.preflight import derived_port, port_taken
from kvrelay.cli.up import banner, config_from_args, placement, plan_children
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.model_info import ConfigError, check_engine_config, read_model_shape
from kvrelay.gateway.config import GatewayConfig


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVRELAY_") and n != "KVRELAY_CACHE_DIR"]:
        monkeypatch.delenv(name)


@pytest.fixture
def listening():
    """A port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize(("argv", "flag", "words"), [
    (["--prefill", "0", "--decode", "0"], "--decode", "nothing to serve"),
    (["--prefill", "1", "--decode", "0"], "--decode", "hand their KV"),
    (["--colocated", "--prefill", "2"], "--prefill", "--colocated"),
    (["--decode", "-1"], "--decode", "below 0"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory", "negative"),
    (["--kv-cache-memory=-1GiB"], "--kv-cache-memory", "negative"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory", "must be positive"),
    (["--kv-cache-memory", "1MiB"], "--kv-cache-memory", "give at least 6MiB"),
    (["--kv-cache-memory", "64MiB", "--max-model-len", "4096"], "--kv-cache-memory", "4096 tokens (max_model_len)"),
    (["--max-model-len", "100000"], "--max-model-len", "context of 8192 tokens"),
    (["--max-model-len", "1"], "--max-model-len", "no room"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size", "not supported"),
    (["-pp", "2"], "--pipeline-parallel-size", "not supported"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization", "(0, 1]"),
    (["--max-num-seqs", "0"], "--max-num-seqs", "below 1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens", "below 1"),
    (["--device", "tpu"], "--device", "not auto, cpu, cuda"),
    (["--model", "/no/such/model"], "--model", "no file or folder"),
    (["--port", "8000", "--grpc-port", "8000"], "--grpc-port", "is --port too"),
    (["--keep-logs", "0"], "--keep-logs", "below 1"),
    (["--shutdown-grace", "-1"], "--shutdown-grace", "below 0"),
    (["--frobnicate"], "--frobnicate", "unrecognized argument"),
    (["--max-num-seqz", "2"], "--max-num-seqz", "did you mean --max-num-seqs?"),
    (["--index-backend", "redis"], "--index-backend", "a flag of `kvrelay gateway`, not of `kvrelay up`"),
    (["--kv-port", "1"], "--kv-port", "a flag of `kvrelay prefill` and `kvrelay decode`"),
    (["--temperature", "0.5"], "--temperature", "`kvrelay generate`"),
    (["--quantization", "bnb"], "--quantization", "invalid choice: 'bnb'"),
    (["--quantization", "awq"], "--quantization", "awq loads a checkpoint folder whose config.json says so"),
    (["--quantization", "gguf", "--device", "cuda"], "--quantization", "gguf runs on CPU only"),
    (["--enforce-eager"], "--enforce-eager", "vLLM's"),
    (["--dtype", "int3"], "--dtype", "unknown dtype"),
])
def test_up_refuses_before_starting_anything(capsys, tmp_path, argv, flag, words):
    err = _refused(capsys, ["up", "--log-dir", str(tmp_path / "logs"), *argv])
    assert err.startswith("kvrelay up: error: ") and flag in err and words in err, err
    assert not (tmp_path / "logs").exists()  # no run was started, so no log folder either


def test_a_taken_port_is_refused_with_its_flag(capsys, tmp_path, listening):
    err = _refused(capsys, ["up", "--log-dir", str(tmp_path), "--port", str(listening)])
    assert err.startswith(f"kvrelay up: error: --port: {listening} is taken on 127.0.0.1") and "--port" in err
    err = _refused(capsys, ["up", "--log-dir", str(tmp_path), "--grpc-port", str(listening)])
    assert err.startswith(f"kvrelay up: error: --grpc-port: {listening} is taken")
    assert port_taken("127.0.0.1", listening) and port_taken("127.0.0.1", 0) is None


def test_node_and_gateway_commands_check_what_is_cheap(capsys, listening):
    assert _refused(capsys, ["decode", "--port", str(listening)]).startswith(
        f"kvrelay decode: error: --port: {listening} is taken")
    assert "--kv-cache-memory" in _refused(capsys, ["prefill", "--port", "0", "--kv-cache-memory", "2MiB"])
    assert _refused(capsys, ["gateway", "--redis-url", "redis://127.0.0.1:1/0", "--port", str(listening)]).startswith(
        f"kvrelay gateway: error: --port: {listening} is taken")
    # --reuse-port: a rolling restart's successor starts while its predecessor holds the ports.
    check_gateway(GatewayConfig(port=listening, grpc_port=listening + 1, reuse_port=True))
    with pytest.raises(UsageError, match="is taken"):
        check_gateway(GatewayConfig(port=listening, grpc_port=listening + 1))
    # A vLLM flag kvrelay lacks, on a command other than up (which takes --tensor-parallel-size 1):
    assert "vLLM's" in _refused(capsys, ["decode", "--tensor-parallel-size", "2"])


@pytest.mark.skipif(not __import__("shutil").which("true"), reason="posix")
def test_cuda_is_refused_on_a_cpu_build_of_torch(capsys, tmp_path):
    import torch

    if torch.version.cuda:
        pytest.skip("this torch has CUDA")
    assert "this torch is a CPU build" in _refused(capsys, ["up", "--log-dir", str(tmp_path), "--device", "cuda"])


def test_the_model_shape_is_read_without_loading_or_converting(tmp_path, monkeypatch, default_model_dir):
    converted = read_model_shape("default")
    assert (converted.context_length, converted.num_layers, converted.num_kv_heads, converted.head_size) == \
        (8192, 30, 3, 64)
    assert converted.kv_bytes_per_token(2) == 23040 and str(default_model_dir) in converted.source
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))  # no conversion cached: the GGUF's metadata
    metadata = read_model_shape("default")
    assert metadata.source.startswith("the metadata of ") and metadata.source.endswith(".gguf")
    assert (metadata.context_length, metadata.num_kv_heads, metadata.head_size) == (8192, 3, 64)
    assert not any(tmp_path.iterdir())  # nothing was converted
    assert read_model_shape(str(default_model_dir)) == converted.__class__(
        default_model_dir.name, 8192, 30, 3, 64, str(default_model_dir / "config.json"))


def test_engine_checks_pass_what_runs_and_name_the_field():
    shape = check_engine_config(EngineConfig())
    assert shape.model_id == "SmolLM2-135M-Instruct"
    # One sequence of the least useful context fits exactly: 256 tokens x 23040 bytes.
    check_engine_config(EngineConfig().with_kwargs(kv_cache_memory=256 * 23040), shape)
    with pytest.raises(ConfigError) as e:
        check_engine_config(EngineConfig().with_kwargs(kv_cache_memory=256 * 23040 - 1), shape)
    assert e.value.field == "kv_cache_memory"
    with pytest.raises(ConfigError, match="46080 bytes per token"):  # an explicit float32: 4 bytes an element
        check_engine_config(EngineConfig().with_kwargs(dtype="float32", kv_cache_memory=256 * 23040), shape)


def test_derived_ports(listening):
    assert derived_port("127.0.0.1", listening - 1, 1) != listening  # taken: another one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert derived_port("127.0.0.1", free - 1, 1) == free


def _config(*argv: str):
    return config_from_args(parse(["up", *argv]))


def test_up_hands_every_vllm_flag_to_the_processes_that_use_it():
    config = _config("--prefill", "1", "--decode", "1", "--max-num-seqs", "2", "--max-num-batched-tokens", "256",
                     "--no-enable-prefix-caching", "--seed", "7", "--gpu-memory-utilization", "0.5", "--device",
                     "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--tool-call-parser",
                     "llama3_json", "--allowed-origins", "http://a.example", "http://b.example", "--api-key",
                     "sk-secret-key", "--shutdown-grace", "3", "--enable-auto-tool-choice", "-tp", "1")
    where = placement(config)
    ports = FleetPorts(8100, 8101, {"prefill-0": (1, 2), "decode-0": (3, 4)})
    children = {c.name: c for c in plan_children(config, "redis://127.0.0.1:1/0", where, ports)}
    for name in ("prefill-0", "decode-0"):
        argv = " ".join(children[name].argv)
        for flag in ("--max-num-seqs 2", "--max-num-batched-tokens 256", "--no-enable-prefix-caching", "--seed 7",
                     "--gpu-memory-utilization 0.5", "--device cpu", f"--kv-cache-memory {64 * 2**20}",
                     "--max-model-len 1024", "--shutdown-grace 3"):
            assert flag in argv, (name, flag)
    assert "--port 3 --metrics-port 4" in " ".join(children["decode-0"].argv)
    gateway = children["gateway"]
    argv = " ".join(gateway.argv)
    for flag in ("--port 8100", "--grpc-port 8101", "--reuse-port", "--tool-call-parser llama3_json", "--fleet-metrics",
                 "--allowed-origins http://a.example http://b.example", "--shutdown-grace 3"):
        assert flag in argv, flag
    # Secrets travel in the environment, never on a command line: the key, and Redis's URL (it carries a password).
    assert "sk-secret-key" not in argv and gateway.env == {"KVRELAY_API_KEY": "sk-secret-key",
                                                           "KVRELAY_REDIS_URL": "redis://127.0.0.1:1/0"}
    assert all("redis://" not in " ".join(c.argv) and c.env["KVRELAY_REDIS_URL"] for c in children.values())
    assert "--max-num-seqs" not in argv and "--tool-call-parser" not in " ".join(children["decode-0"].argv)


def test_flags_left_out_are_not_passed_on():
    config = _config()
    children = plan_children(config, "redis://127.0.0.1:1/0", placement(config))
    for child in children:
        for flag in ("--max-num-seqs", "--seed", "--device", "--enable-prefix-caching", "--no-enable-prefix-caching",
                     "--gpu-memory-utilization", "--tool-call-parser", "--allowed-origins"):
            assert flag not in child.argv  # each part's own default applies
        assert child.env == {"KVRELAY_REDIS_URL": "redis://127.0.0.1:1/0"}  # no key given: none passed on


def test_the_banner_prints_every_port_and_masks_the_key(tmp_path):
    config = _config("--api-key", "sk-do-not-print-me", "--served-model-name", "m", "--port", "8100")
    ports = FleetPorts(8100, 8101, {"colocated-0": (20001, 20002)})
    text = banner(Fleet(config, placement(config), ports, Path(tmp_path)))
    assert "sk-do-not-print-me" not in text and "sk-..." in text and "$KVRELAY_API_KEY" in text
    for part in ("http://127.0.0.1:8100/v1", "http://127.0.0.1:8100/metrics", "127.0.0.1:8101", "127.0.0.1:20001",
                 "127.0.0.1:20002", str(tmp_path), "kvrelay is up"):
        assert part in text
    assert text.count("placement") == 0  # the placement note is logged once, at start


def test_a_keys_file_reaches_the_gateway_and_the_launcher_keeps_a_key_of_its_own(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    keys.write_text("- key: sk-tenant-a-0001\n  tenant: a\n  rpm: 10\n")
    config = _config("--api-keys-file", str(keys), "--otlp-traces-endpoint", "http://127.0.0.1:4317")
    fleet = Fleet(config, placement(config), FleetPorts(8100, 8101, {"colocated-0": (1, 2)}), tmp_path)
    children = {c.name: c for c in plan_children(config, "redis://127.0.0.1:1/0", fleet.placement, fleet.ports,
                                                 fleet.api_key)}
    gateway = children["gateway"]
    assert f"--api-keys-file {keys}" in " ".join(gateway.argv)
    # The launcher's readiness checks need a key; it makes one nobody else knows, passed in the environment.
    assert len(fleet.api_key) >= 40 and gateway.env["KVRELAY_API_KEY"] == fleet.api_key
    assert fleet.headers == {"Authorization": f"Bearer {fleet.api_key}"}
    assert all("--otlp-traces-endpoint http://127.0.0.1:4317" in " ".join(c.argv) for c in children.values())
    keys.write_text("- key: short\n")  # a bad keys file is refused before anything starts, in one line
    assert main(["up", "--api-keys-file", str(keys), "--port", str(_free_port()),
                 "--log-dir", str(tmp_path / "logs")]) == 2
    assert "entry 0: 'key' must be a string of at least 8 characters" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_several_gateways_share_the_ports_and_gateways_below_one_are_refused(capsys):
    config = _config("--gateways", "3", "--api-key", "sk-secret-key")
    ports = FleetPorts(8100, 8101, {"colocated-0": (1, 2)})
    children = plan_children(config, "redis://127.0.0.1:1/0", placement(config), ports)
    gateways = [c for c in children if c.is_gateway]
    assert [g.name for g in gateways] == ["gateway-0", "gateway-1", "gateway-2"]
    assert len({" ".join(g.argv) for g in gateways}) == 1  # the same command: one port, SO_REUSEPORT
    assert "--port 8100 --grpc-port 8101 --reuse-port" in " ".join(gateways[0].argv)
    assert all(g.env["KVRELAY_API_KEY"] == "sk-secret-key" for g in gateways)
    assert [c.name for c in children if not c.is_gateway] == ["colocated-0"]
    assert "--gateways" in _refused(capsys, ["up", "--gateways", "0"])
