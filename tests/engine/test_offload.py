"""The KV offload tier, engine side: blocks evicted from a small KV cache come back from the host's store
instead of being recomputed, with the tokens a cache that never evicted gives; what fails verification is a miss.

Engines here are tiny random Llama checkpoints in this process (float32, 16 blocks of 4 tokens), each with a
store under tmp_path, so two engines of one test share it as two nodes of a host do.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from kvrelay.common.hashing import hash_blocks, root_hash
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvrelay.engine.core import EngineCore
from kvrelay.engine.model_info import ConfigError, check_engine_config
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import run_colocated

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny")))


def _engine(model: str, store, speculative: SpeculativeConfig | None = None, **cache) -> EngineCore:
    """16 blocks of 4 tokens over a store in `store` (16 MiB of memory unless `cache` says otherwise)."""
    return EngineCore(EngineConfig(
        model=ModelConfig(model=model, dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=16, kv_offload_path=str(store),
                          **{"kv_offload_bytes": 1 << 24, **cache}),
        scheduler=SchedulerConfig(max_num_batched_tokens=64), speculative=speculative,
    ))


def _serve(engine: EngineCore, prompts: list[list[int]], tag: str) -> list[list[int]]:
    return [run_colocated(engine, f"{tag}-{i}", p, GREEDY) for i, p in enumerate(prompts)]


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(13 * i + 7 * seed + 3) % 250 + 1 for i in range(n)]


def _reference(model: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = EngineCore(EngineConfig(model=ModelConfig(model=model, dtype="float32", device="cpu"),
                                     cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=256)))
    return _serve(engine, prompts, "ref")


def test_evicted_blocks_come_back_from_the_store_with_the_same_tokens(model, tmp_path):
    prompts = [_prompt(s) for s in range(3)]
    want = _reference(model, prompts)
    engine = _engine(model, tmp_path / "shm")
    # Each 48-token sequence takes 12 of the 16 blocks: every prompt evicts the one before.
    assert _serve(engine, prompts, "a") == want
    engine.offload.flush()
    assert engine.offload.stats.offloaded_blocks >= 9
    again = run_colocated(engine, "again", prompts[0], GREEDY)
    assert again == want[0]
    # 40 prompt tokens: 9 whole blocks before the last token, all from the store
    assert engine.offload.stats.loaded_blocks == 9
    assert engine.token_counts("again") is None
    engine.shutdown()


def test_another_engine_on_the_host_loads_what_one_offloaded(model, tmp_path):
    prompts = [_prompt(s) for s in range(10, 13)]
    want = _reference(model, prompts)
    writer = _engine(model, tmp_path / "shm")
    _serve(writer, prompts, "w")
    writer.shutdown()  # written, then gone: the store outlives it
    reader = _engine(model, tmp_path / "shm")
    assert run_colocated(reader, "r-0", prompts[0], GREEDY) == want[0]
    assert reader.offload.stats.loaded_blocks == 9
    reader.shutdown()


def test_a_corrupted_block_is_a_counted_miss_and_the_tokens_are_still_right(model, tmp_path):
    prompts = [_prompt(s) for s in range(20, 23)]
    want = _reference(model, prompts)
    engine = _engine(model, tmp_path / "shm")
    _serve(engine, prompts, "c")
    engine.offload.flush()
    store = engine.offload.store.tiers[0]
    # The third block of prompt 0: the first two load, the rest is computed.
    hashes = hash_blocks(prompts[0], BLOCK, root_hash(engine.info.model_id, BLOCK))
    path = store.file(engine.offload.key(hashes[2]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert run_colocated(engine, "c-again", prompts[0], GREEDY) == want[0]
    assert store.stats.checksum_failures == 1 and not path.exists()
    assert engine.offload.stats.loaded_blocks == 2
    engine.shutdown()


def test_disk_tier_takes_what_memory_evicts_and_serves_it(model, tmp_path):
    prompts = [_prompt(s) for s in range(30, 34)]
    want = _reference(model, prompts)
    engine = _engine(model, tmp_path / "shm", kv_offload_bytes=40_000, kv_offload_dir=str(tmp_path / "disk"),
                     kv_offload_disk_bytes=1 << 24)
    _serve(engine, prompts, "d")
    engine.offload.flush()
    memory, disk = engine.offload.store.tiers
    assert memory.used_bytes() <= 40_000 and memory.stats.evictions > 0 and disk.stats.writes > 0
    assert run_colocated(engine, "d-again", prompts[0], GREEDY) == want[0]
    assert disk.stats.hits > 0 and engine.offload.stats.loaded_blocks == 9
    engine.shutdown()



def test_a_draft_models_kv_comes_back_with_the_targets(model, tmp_path):
    """The target drafting for itself accepts its greedy drafts only if the draft's KV of the loaded prefix is
    right: it travels in the same payload."""
    prompts = [_prompt(s) for s in range(40, 43)]
    want = _reference(model, prompts)
    engine = _engine(model, tmp_path / "shm",
                     SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=3))
    _serve(engine, prompts, "s")
    engine.offload.flush()  # the writer runs behind the steps: on loaded cores the repeat came before the files
    before = replace(engine.counters())
    assert run_colocated(engine, "s-again", prompts[0], GREEDY) == want[0]
    after = engine.counters()
    assert engine.offload.stats.loaded_blocks == 9
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 0 and after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == drafted
    engine.shutdown()


def test_serving_goes_on_when_the_stores_folder_is_removed(model, tmp_path, caplog):
    prompts = [_prompt(s) for s in range(50, 54)]
    want = _reference(model, prompts)
    engine = _engine(model, tmp_path / "shm")
    assert run_colocated(engine, "f-0", prompts[0], GREEDY) == want[0]
    shutil.rmtree(tmp_path / "shm")
    got = _serve(engine, prompts, "f")
    engine.offload.flush()
    assert got == want  # prompt 0 again too: computed, nothing of it found
    tier = engine.offload.store.tiers[0]
    assert not tier.enabled and tier.stats.write_failures == 1 and "offloading to it stops" in caplog.text
    engine.shutdown()


def test_a_tier_larger_than_its_filesystem_has_room_for_is_refused_at_start(model, tmp_path):
    free = shutil.disk_usage(tmp_path).free

    def config(**cache) -> EngineConfig:
        return EngineConfig(model=ModelConfig(model=model, dtype="float32", device="cpu"),
                            cache=CacheConfig(kv_offload_path=str(tmp_path / "shm"), **cache))

    check_engine_config(config(kv_offload_bytes=1 << 20))
    with pytest.raises(ConfigError, match=r"the filesystem of .*shm has .* for it; give less") as e:
        check_engine_config(config(kv_offload_bytes=free + (1 << 40)))
    assert e.value.field == "kv_offload_bytes"  # the node and kvrelay up name the flag: --kv-offload-bytes
    with pytest.raises(ConfigError) as e:
        check_engine_config(config(kv_offload_dir=str(tmp_path / "disk" / "deeper"),
                                   kv_offload_disk_bytes=free + (1 << 40)))
    assert e.value.field == "kv_offload_disk_bytes"
