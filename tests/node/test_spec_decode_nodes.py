"""Speculative decoding on decode nodes after disaggregation: real prefill and decode processes on loopback
(ucx over tcp), the default model (fp32) as the target. Decode nodes run n-gram lookup, a tiny random draft
model, and the default model as its own draft; the prefill node runs none (it never decodes).

Greedy output of several concurrent requests (a mixed batch on the decode node) equals the colocated engine
without speculation; a seeded sampled request equals the colocated engine with the same speculation (and, for
n-gram lookup, the one without it); the vLLM spec_decode metrics count the drafts; no block is leaked.
"""

from __future__ import annotations

import itertools
import json

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvrelay.engine.core import EngineCore
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import (
    BLOCK,
    CHUNK,
    all_blocks_free,
    disaggregated,
    in_thread,
    run_colocated,
    start_nodes,
    stop_nodes,
    wait_for,
)

KV_MEMORY = 96 * 2**20
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
METHODS = ("ngram", "tiny_draft", "self_draft")
_ids = itertools.count()


def node_args(model: str, *extra: str) -> list[str]:
    return ["--model", model, "--dtype", "float32", "--num-threads", "1", "--connector", "ucx",
            "--max-num-batched-tokens", str(CHUNK), "--block-size", str(BLOCK), "--kv-cache-memory",
            str(KV_MEMORY), "--shutdown-timeout", "10", *extra]


def engine(model: str, spec: dict | None) -> EngineCore:
    """The colocated reference, configured like the nodes."""
    return EngineCore(EngineConfig(
        model=ModelConfig(model=model, dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory=KV_MEMORY),
        scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK),
        speculative=SpeculativeConfig.from_dict(spec),
    ))


@pytest.fixture(scope="module")
def specs(tmp_path_factory, default_model_dir) -> dict[str, dict]:
    draft = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("draft") / "tiny-draft", vocab_size=49152,
                                 max_position_embeddings=8192)
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
        "tiny_draft": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "self_draft": {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 2},
    }


@pytest.fixture(scope="module")
def fleet(default_model_dir, specs):
    model = str(default_model_dir)
    roles = [("prefill", node_args(model))]
    roles += [("decode", node_args(model, "--speculative-config", json.dumps(specs[m]))) for m in METHODS]
    nodes = start_nodes(roles, timeout=300)
    yield nodes[0], dict(zip(METHODS, nodes[1:]))
    assert stop_nodes(nodes) == [0] * len(nodes), "".join(n.log_tail() for n in nodes)


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    text = ("Every request's KV cache lives in fixed-size blocks; a block table maps each request's positions "
            "to blocks, so that requests sharing a prefix share its blocks.")
    return [
        default_tokenizer.encode(f"Copy this sentence: {text}\nCopy: {text[:50]}"),
        default_tokenizer.apply_chat_template([{"role": "user", "content": "Give me two tips for sleeping well."}]),
        default_tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"),
    ]


@pytest.fixture(scope="module")
def plain(default_model_dir, prompts) -> dict[str, list[list[int]]]:
    ref = engine(str(default_model_dir), None)
    return {
        "greedy": [run_colocated(ref, f"c{next(_ids)}", p, GREEDY) for p in prompts],
        "seeded": [run_colocated(ref, f"c{next(_ids)}", prompts[0], SEEDED)],
    }


@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", METHODS)
def test_speculative_decode_node_matches_colocated(fleet, specs, plain, prompts, default_model_dir, method):
    prefill, decodes = fleet
    decode = decodes[method]
    # Greedy: every request of a concurrent batch equals the colocated engine without speculation.
    runs = [in_thread(disaggregated, prefill, decode, f"r{next(_ids)}", p, GREEDY) for p in prompts]
    for (thread, box), want in zip(runs, plain["greedy"]):
        thread.join(600)
        assert "error" not in box, box.get("error")
        assert box["result"].tokens == want

    # Seeded sampling: the colocated engine with the same speculation gives the same tokens.
    got = disaggregated(prefill, decode, f"r{next(_ids)}", prompts[0], SEEDED).tokens
    reference = engine(str(default_model_dir), specs[method])
    assert got == run_colocated(reference, f"c{next(_ids)}", prompts[0], SEEDED)
    if method == "ngram":  # certain drafts verified as plain samples: the tokens without speculation
        assert got == plain["seeded"][0]

    metrics = decode.metrics()
    drafts, tokens, accepted, per_pos = (metrics.value(f"vllm:spec_decode_num_{name}_total") or 0 for name in
                                         ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"))
    assert drafts > 0 and tokens >= drafts and per_pos == accepted, metrics.samples
    if method != "tiny_draft":
        assert accepted > 0
    for node in (prefill, decode):
        wait_for(lambda n=node: all_blocks_free(n), 10, f"{node.role} node to free every block")
