"""Pooling requests on the wire: their params and the vector survive the proto round trip, and a model folder's
sentence-transformers modules say how it pools."""

import json

from kvrelay.common import wire
from kvrelay.common.sampling_params import PoolingParams, PoolingType, SamplingParams
from kvrelay.model_files.pooling import pooling_config


def test_pooling_params_and_the_vector_round_trip():
    for pooling in (PoolingParams(), PoolingParams(PoolingType.MEAN, normalize=False, dimensions=8)):
        params = SamplingParams(max_tokens=1, pooling=pooling)
        assert wire.sampling_from_proto(wire.sampling_to_proto(params)) == params
    plain = SamplingParams(max_tokens=3)
    assert wire.sampling_from_proto(wire.sampling_to_proto(plain)).pooling is None
    chunk = wire.TokenChunk((), finish_reason="stop", num_prompt_tokens=5, embedding=(0.5, -0.25, 1.0))
    assert wire.chunk_from_proto(wire.chunk_to_proto(chunk)) == chunk


def test_a_folder_says_how_it_pools(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 96}))
    assert pooling_config(tmp_path) == pooling_config(tmp_path).__class__("last", 96)  # a decoder: last token
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert pooling_config(tmp_path).pooling_type == "mean"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert pooling_config(tmp_path).pooling_type == "cls"
