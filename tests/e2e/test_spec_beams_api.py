"""Beam search and speculative decoding through the OpenAI API, on a real fleet: a prefill node and a decode node
running n-gram speculation (real processes, ucx), a real Redis, the gateway, and the unmodified `openai` SDK.
The model is a tiny random llama carrying the default model's tokenizer, so text round-trips.

- use_beam_search with n and best_of returns the n best of best_of beams, equal to `LLM.beam_search` on the
  same weights (streamed or not); bad combinations are 400s naming the field.
- Greedy completions from the speculating decode node equal the engine without speculation, stop strings
  included, and the node exports vLLM's spec_decode metrics.
- `kvrelay up --speculative-config` passes the config to decode nodes only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import openai
import pytest

from kvrelay.engine.llm import LLM, BeamSearchParams, SamplingParams
from tests.helpers.gateway import GatewayThread
from tests.helpers.models import make_tiny_with_tokenizer
from tests.helpers.nodes import start_nodes, stop_nodes, tiny_args, wait_for

MODEL = "tiny-spec"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir) -> str:
    return str(make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny") / MODEL, Path(default_model_dir)))


@pytest.fixture(scope="module")
def fleet(model):
    from kvrelay.index.redis_server import start_redis

    redis = start_redis()
    reg = ["--redis-url", redis.url, "--heartbeat-seconds", "0.5", "--registry-ttl", "3"]
    nodes = []
    try:
        nodes = start_nodes([("prefill", tiny_args(model, "ucx", *reg, blocks=512)),
                             ("decode", tiny_args(model, "ucx", *reg, "--speculative-config", json.dumps(SPEC),
                                                  blocks=512))])
        gw = GatewayThread(model=model, redis_url=redis.url, startup_timeout=30, local_prefill_threshold=4)
        wait_for(lambda: len(gw.gateway.discovery.routable("decode")) == 1
                 and len(gw.gateway.discovery.routable("prefill")) == 1, 30, "nodes routable")
        yield gw, nodes
        gw.close()
    finally:
        assert stop_nodes(nodes) == [0] * len(nodes), "".join(n.log_tail() for n in nodes)
        redis.stop()


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return fleet[0].client(api_key="unused")


@pytest.fixture(scope="module")
def offline(model) -> LLM:
    """The same weights in this process, without speculation."""
    return LLM(model=model, dtype="float32", num_gpu_blocks_override=512)


def test_beam_search_equals_offline(client, offline):
    width, n = 3, 2
    want = offline.beam_search([PROMPT], BeamSearchParams(beam_width=width, max_tokens=10))[0].sequences[:n]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=10, n=n, best_of=width, temperature=0,
                  extra_body={"use_beam_search": True})
    resp = client.completions.create(**kwargs)
    tok = offline.tokenizer
    prompt_len = len(tok.encode(PROMPT))
    expected = [tok.decode(s.tokens[prompt_len:]) for s in want]
    assert [c.text for c in resp.choices] == expected
    assert [c.finish_reason for c in resp.choices] == [s.finish_reason for s in want]
    assert resp.usage.completion_tokens == sum(len(s.tokens) - prompt_len for s in want)
    streamed = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(n)] == expected


def test_beam_search_bad_requests(client):
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"use_beam_search": True})
    for extra, param in (({"temperature": 0.7}, "temperature"), ({"n": 3, "best_of": 2}, "best_of"),
                         ({"logprobs": 1}, "logprobs"), ({"n": 11}, "beam_width")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**{**base, **extra})
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body


def test_speculating_decode_node_is_exact(client, fleet, offline):
    _, (prefill, decode) = fleet
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = offline.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == want.text and resp.usage.completion_tokens == 32
    # A stop string inside a run of accepted drafts ends the text where it starts, as without speculation.
    stop = want.text[len(want.text) // 2 : len(want.text) // 2 + 4]
    assert stop.strip()
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == want.text[: want.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    metrics = decode.metrics()
    assert metrics.value("vllm:spec_decode_num_draft_tokens_total") > 0
    assert metrics.select("vllm:spec_decode_num_accepted_tokens_per_pos_total")


def test_up_passes_the_speculative_config_to_decode_nodes_only():
    from kvrelay.cli import up

    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    config = up.config_from_args(parser.parse_args(["up", "--prefill", "1", "--decode", "2", "--speculative-config",
                                                    json.dumps(SPEC)]))
    children = up.plan_children(config, "redis://127.0.0.1:1/0", up.placement(config))
    argvs = {c.name: c.argv for c in children}
    for name in ("decode-0", "decode-1"):
        i = argvs[name].index("--speculative-config")
        assert json.loads(argvs[name][i + 1]) == SPEC
    assert "--speculative-config" not in argvs["prefill-0"] and "--speculative-config" not in argvs["gateway"]
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--speculative-config", '{"method": "eagle"}'])
