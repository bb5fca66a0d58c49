"""Every default lives in one config record and the flags read theirs from it: `kvrelay gateway` from
GatewayConfig, the node commands from NodeConfig (the engine a node serves with), `generate` from the engine's
own EngineConfig, `kvrelay up` from UpConfig. And every flag says what it does."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os

import pytest

from kvrelay.cli import gateway, generate, node, up
from kvrelay.cli.args import UsageError
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import engine_config
from kvrelay.engine.config import EngineConfig, SchedulingPolicy
from kvrelay.gateway.admission import Admission
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.discovery import DiscoveryConfig
from kvrelay.gateway.dispatch import DispatchConfig
from kvrelay.gateway.liveness import Liveness
from kvrelay.gateway.node_client import Timeouts
from kvrelay.node.config import SERVING_ENGINE, NodeConfig


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    for name in [n for n in os.environ if n.startswith("KVRELAY_")]:  # the node flags' environment defaults
        monkeypatch.delenv(name)
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    for command in (up, gateway, node, generate):
        command.register(sub)
    return p


def test_every_flag_has_help(parser):
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"up", "gateway", "prefill", "decode", "generate"}
    missing = [f"{name} {action.option_strings[0]}" for name, p in commands.items() for action in p._actions
               if action.option_strings and not (action.help or "").strip()]
    assert missing == []


def test_gateway_flags_default_to_the_config(parser):
    args = parser.parse_args(["gateway", "--decode", "127.0.0.1:9"])
    assert gateway.config_from_args(args) == GatewayConfig(decode=("127.0.0.1:9",))


def test_gateway_parts_default_to_the_config():
    g = GatewayConfig()
    discovery = DiscoveryConfig("m", 16)
    assert (discovery.refresh_s, discovery.health_s, discovery.probe_timeout_s) == \
        (g.refresh_interval, g.health_interval, g.probe_timeout)
    assert DispatchConfig() == DispatchConfig(g.kv_lease_ms, g.migration_limit, g.queue_timeout, g.capacity_wait)
    assert Admission() == Admission(g.max_concurrent_requests, g.request_timeout)
    assert Timeouts().prefill_s == g.prefill_timeout
    assert inspect.signature(Liveness).parameters["stall_s"].default == g.stall_timeout


def test_gateway_flags_reach_the_config(parser):
    args = parser.parse_args(["gateway", "--redis-url", "redis://h/0", "--served-model-name", "a", "b",
                              "--tool-call-parser", "none", "--allowed-origins", "*", "--probe-timeout", "0.3",
                              "--prefill", "p:1", "--prefill", "p:2", "--api-key", "k"])
    config = gateway.config_from_args(args)
    assert config == GatewayConfig(redis_url="redis://h/0", served_model_names=("a", "b"), tool_call_parser=None,
                                   allowed_origins=("*",), probe_timeout=0.3, prefill=("p:1", "p:2"), api_key="k")
    with pytest.raises(ValueError, match="--redis-url"):
        gateway.config_from_args(parser.parse_args(["gateway"]))


@pytest.mark.parametrize(("role", "port"), [("prefill", 50061), ("decode", 50062)])
def test_node_flags_default_to_the_config(parser, role, port):
    assert node.node_config(parser.parse_args([role])) == NodeConfig(port=port)


def test_a_node_serves_with_its_own_engine_defaults():
    # What a server changes of the engine's offline defaults, where a reader of the node's config sees it.
    serving, offline = SERVING_ENGINE.scheduler, EngineConfig().scheduler
    assert (serving.policy, serving.max_waiting_requests, serving.kv_lease_s) == (SchedulingPolicy.SJF, 1024, 120.0)
    assert (offline.policy, offline.max_waiting_requests) == (SchedulingPolicy.FCFS, 0)
    assert dataclasses.replace(serving, policy=offline.policy, max_waiting_requests=0, kv_lease_s=offline.kv_lease_s) \
        == offline
    assert NodeConfig().engine == SERVING_ENGINE


def test_node_flags_reach_the_config(parser):
    config = node.node_config(parser.parse_args(
        ["decode", "--max-waiting-requests", "7", "--scheduling-policy", "priority", "--kv-lease-seconds", "9",
         "--seed", "5", "--connector", "ucx", "--kv-host", "10.0.0.1", "--num-threads", "3", "--local-nodes", "2"]))
    assert (config.engine.scheduler.max_waiting_requests, config.engine.scheduler.policy,
            config.engine.scheduler.kv_lease_s) == (7, SchedulingPolicy.PRIORITY, 9.0)
    assert config.engine.model.seed == 5 and (config.num_threads, config.local_nodes) == (3, 2)
    assert (config.connector.name, config.connector.host) == ("ucx", "10.0.0.1")
    assert node.node_config(parser.parse_args(["decode", "-q", "gguf"])).engine.model.quantization == "gguf"


def test_up_hands_quantization_to_every_node(parser):
    from kvrelay.cli.fleet import engine_flags

    config = up.config_from_args(parser.parse_args(["up", "--quantization", "gguf"]))
    assert up.node_engine(config).model.quantization == "gguf"
    flags = engine_flags(config)
    assert flags[flags.index("--quantization") + 1] == "gguf"
    assert "--quantization" not in engine_flags(up.UpConfig())


def test_up_hands_the_kv_cache_dtype_to_every_node_and_the_gateway(parser):
    from kvrelay.cli.fleet import engine_flags, gateway_flags

    config = up.config_from_args(parser.parse_args(["up", "--kv-cache-dtype", "int8"]))
    assert up.node_engine(config).cache.kv_cache_dtype == "int8"
    for flags in (engine_flags(config), gateway_flags(config)):
        assert flags[flags.index("--kv-cache-dtype") + 1] == "int8"
    assert "--kv-cache-dtype" not in engine_flags(up.UpConfig()) + gateway_flags(up.UpConfig())
    gateway = parser.parse_args(["gateway", "--kv-cache-dtype", "fp8"])
    assert gateway.kv_cache_dtype == "fp8"


def test_up_hands_the_priority_step_gap_to_every_node(parser):
    from kvrelay.cli.fleet import engine_flags

    config = up.config_from_args(parser.parse_args(["up", "--priority-step-gap", "0"]))
    assert up.node_engine(config).scheduler.priority_step_gap == 0
    flags = engine_flags(config)
    assert flags[flags.index("--priority-step-gap") + 1] == "0"
    assert "--priority-step-gap" not in engine_flags(up.UpConfig())
    assert node.node_config(parser.parse_args(["decode", *flags])).engine.scheduler.priority_step_gap == 0


def test_up_hands_the_access_log_to_the_gateway(parser):
    from kvrelay.cli.fleet import gateway_flags

    config = up.config_from_args(parser.parse_args(["up", "--log-requests"]))
    assert config.log_requests and "--log-requests" in gateway_flags(config)
    assert "--log-requests" not in gateway_flags(up.UpConfig())
    assert parser.parse_args(["gateway", *gateway_flags(config)]).log_requests


def test_up_hands_the_offload_tier_to_every_node(parser, tmp_path):
    from kvrelay.cli.fleet import engine_flags

    config = up.config_from_args(parser.parse_args(
        ["up", "--kv-offload-bytes", "1GiB", "--kv-offload-dir", str(tmp_path), "--kv-offload-disk-bytes", "2GiB"]))
    cache = up.node_engine(config).cache
    assert (cache.kv_offload_bytes, cache.kv_offload_dir, cache.kv_offload_disk_bytes) == (2**30, str(tmp_path),
                                                                                           2 * 2**30)
    flags = engine_flags(config)
    assert flags[flags.index("--kv-offload-bytes") + 1] == str(2**30) and "--kv-offload-path" not in flags
    assert "--kv-offload-bytes" not in engine_flags(up.UpConfig())
    assert node.node_config(parser.parse_args(["decode", *flags[flags.index("--kv-offload-bytes"):]])).engine.cache \
        .kv_offload_disk_bytes == 2 * 2**30
    with pytest.raises(UsageError, match="a disk tier needs its folder and its size") as e:
        up.node_engine(up.config_from_args(parser.parse_args(["up", "--kv-offload-dir", str(tmp_path)])))
    assert e.value.flag == "--kv-offload-dir"


def test_a_bad_environment_variable_is_reported_when_the_node_starts(parser, monkeypatch):
    monkeypatch.setenv("KVRELAY_MAX_NUM_SEQS", "many")
    p = argparse.ArgumentParser()
    node.register(p.add_subparsers())
    with pytest.raises(ValueError, match="KVRELAY_MAX_NUM_SEQS='many'"):
        node.node_config(p.parse_args(["decode"]))


def test_offline_engine_flags_default_to_the_engine_config(parser):
    assert engine_config(parser.parse_args(["generate", "--prompt", "hi"])) == EngineConfig()


def test_generate_sampling_flags_default_to_its_sampling_params(parser):
    assert generate.sampling_params(parser.parse_args(["generate", "--prompt", "hi"])) == generate.DEFAULTS
    assert (generate.DEFAULTS.temperature, generate.DEFAULTS.max_tokens) == (0.0, 64)  # greedy, and longer
    args = parser.parse_args(["generate", "--prompt", "hi", "--top-k", "5", "--seed", "3", "--ignore-eos"])
    assert generate.sampling_params(args) == SamplingParams(temperature=0.0, max_tokens=64, top_k=5, seed=3,
                                                            ignore_eos=True)


def test_up_flags_default_to_its_config(parser):
    assert up.config_from_args(parser.parse_args(["up"])) == up.UpConfig()
    d, g = up.UpConfig(), GatewayConfig()
    assert (d.port, d.migration_limit, d.routing_policy) == (g.port, g.migration_limit, g.routing_policy)
