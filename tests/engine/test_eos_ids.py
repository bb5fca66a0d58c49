"""End tokens from generation_config beyond the first (Llama 3 instruct's <|eot_id|>) stop the engine too."""

from __future__ import annotations

import json

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvrelay.engine.core import EngineCore
from tests.helpers.models import make_tiny_checkpoint

PROMPT = [5, 17, 33, 9, 41, 7]


def _engine(path) -> EngineCore:
    return EngineCore(EngineConfig(model=ModelConfig(model=str(path), dtype="float32", device="cpu"),
                                   cache=CacheConfig(num_gpu_blocks_override=32)))


def _run(engine: EngineCore, params: dict[str, SamplingParams]) -> dict[str, tuple[list[int], str | None]]:
    for rid, p in params.items():
        engine.add_request(rid, PROMPT, p)
    out: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid in params}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.req_id] = (out[o.req_id][0] + list(o.new_token_ids), o.finish_reason)
    return out


def test_every_generation_config_eos_stops_unless_ignored(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "m")
    greedy = dict(max_tokens=8, temperature=0)
    tokens, _ = _run(_engine(path), {"a": SamplingParams(**greedy, ignore_eos=True)})["a"]
    stop = tokens[3]
    cut = tokens.index(stop)  # its first occurrence ends the generation
    assert stop != 2
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    engine = _engine(path)
    assert engine.info.eos_token_id == 2 and engine.info.extra_eos_token_ids == (stop,)
    out = _run(engine, {"stops": SamplingParams(**greedy), "ignores": SamplingParams(**greedy, ignore_eos=True),
                        "late": SamplingParams(**greedy, min_tokens=8)})
    assert out["stops"] == (tokens[: cut + 1], "stop")
    assert out["ignores"] == (tokens, "length")
    # min_tokens keeps the extra end token from being sampled, as it does for the eos
    assert stop not in out["late"][0] and out["late"][1] == "length"
