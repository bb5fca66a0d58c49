"""Disaggregation at the engine level, in one process over the `local` connector: a prefill engine
computes the prompt and writes its KV into a decode engine's reserved blocks layer by layer; the decode
engine continues. Outputs must equal the colocated engine's, and only missing blocks may move."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.engine.core import EngineCore
from kvrelay.engine.request import KVSendSpec
from kvrelay.kv_transfer import create_connector
from kvrelay.kv_transfer.types import ConnectorConfig
from tests.helpers.models import make_tiny_checkpoint

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny")))


def _engine(path: str, budget: int = 64, blocks: int = 64, connector=None, device: str = "cpu") -> EngineCore:
    """An engine; with a connector it registers its caches there (the receive side) and sends through it."""
    return EngineCore(EngineConfig(
        model=ModelConfig(model=path, dtype="float32", device=device),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, kv_lease_s=0.5),
    ), kv_sender=connector)


def _connector():
    return create_connector("local", ConnectorConfig(name="local"))


def _drain(engine: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return out


_ids = itertools.count()


class Pair:
    def __init__(self, path: str, device: str = "cpu") -> None:
        self.p_conn, self.d_conn = _connector(), _connector()
        self.prefill = _engine(path, connector=self.p_conn, device=device)
        self.decode = _engine(path, connector=self.d_conn, device=device)

    def run(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
        rid = f"r{next(_ids)}"
        res = self.decode.reserve(rid, prompt, params)
        assert res is not None
        tid = f"t-{rid}"
        self.d_conn.expect(tid, list(res.dst_block_ids))
        spec = KVSendSpec(self.d_conn.address, tid, res.num_cached_tokens // BLOCK, res.dst_block_ids)
        self.prefill.add_request(rid, prompt, params, kv_send=spec)
        first = _drain(self.prefill)[rid]
        sent = self.p_conn.wait(tid, timeout=10)
        self.d_conn.wait_received(tid, timeout=10)
        assert self.prefill.release_held(rid)
        out = self.decode.admit_reserved(rid, first[0])
        tokens = list(out.new_token_ids)
        if out.finish_reason is None:
            tokens += _drain(self.decode)[rid]
        return tokens, sent.nbytes


PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=12, ignore_eos=True)]


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_disaggregated_equals_colocated(tiny_dir, params, device):
    colocated = _engine(tiny_dir, device=device)
    pair = Pair(tiny_dir, device)
    prompt = [(7 * i + 3) % 500 for i in range(150)]  # longer than the 64-token chunk budget
    colocated.add_request("c", prompt, params)
    expected = _drain(colocated)["c"]
    got, nbytes = pair.run(prompt, params)
    assert got == expected
    layout = pair.p_conn.layout
    assert nbytes == layout.transfer_nbytes(-(-150 // BLOCK))

    # A prefix-cache hit on the prefill node changes nothing.
    got2, _ = pair.run(prompt, params)
    assert got2 == expected

    # The decode node now holds the prompt's first blocks: only the missing ones move.
    longer = prompt + [11, 12, 13] * 20
    colocated.add_request("c2", longer, params)
    expected2 = _drain(colocated)["c2"]
    got3, nbytes3 = pair.run(longer, params)
    assert got3 == expected2
    held = 150 // BLOCK  # full blocks of the first prompt, cached on the decode node
    assert nbytes3 == layout.transfer_nbytes(-(-len(longer) // BLOCK) - held)
    for eng in (pair.prefill, pair.decode):
        eng.step()
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_unfilled_reservation_expires(tiny_dir):
    import time

    decode = _engine(tiny_dir)
    res = decode.reserve("lost", list(range(40)), SamplingParams(max_tokens=4))
    assert res is not None and decode.kv.pool.num_free_blocks == decode.kv.pool.num_blocks - 3
    time.sleep(0.6)
    decode.step()
    assert decode.kv.pool.num_free_blocks == decode.kv.pool.num_blocks
    with pytest.raises(KeyError, match="no reservation"):
        decode.admit_reserved("lost", 5)
