"""LoRA in the engine: the batched kernel against its torch reference, greedy tokens against HF transformers + PEFT
(3 adapters of different ranks and targets, 2 architectures, base and adapter requests in one batch), block
hashes per adapter, slots and the memory cache under more adapters than slots, and malformed adapters refused
with a message that says what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine import kernels
from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.config import EngineConfig, LoRAConfig, SchedulerConfig, parse_lora_modules
from kvrelay.engine.core import EngineCore
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.llm import LLM, LoRARequest
from kvrelay.engine.lora import AdapterError, UnknownAdapter, lora_add_reference
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.scheduler_output import ModelRunnerOutput
from tests.helpers.lora import PeftReference, make_peft_adapter
from tests.helpers.models import make_tiny_checkpoint, make_tiny_with_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# (name, rank, targets): different ranks, and adapters on part of the projections
ADAPTERS = (("all8", 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
            ("attn4", 4, ("q_proj", "v_proj", "o_proj")),
            ("mlp16", 16, ("gate_proj", "up_proj", "down_proj", "k_proj")))
PROMPTS = ([5, 17, 301, 44, 9, 120, 77, 3, 250, 18, 64, 91, 400, 11, 2, 39, 200, 7],
           [88, 12, 6, 450, 31, 8, 99, 140, 23])


def engine(model: Path, blocks: int = 96, **lora) -> EngineCore:
    return EngineCore(EngineConfig().with_kwargs(model=str(model), dtype="float32", device="cpu", enable_lora=True,
                                                 num_gpu_blocks_override=blocks, **lora))


def generate(core: EngineCore, prompts, params: SamplingParams, loras) -> list[tuple[list[int], int]]:
    """(tokens, cached prompt tokens) per prompt, all queued at once (one batch), each with its adapter."""
    rids = [f"r{i}-{core.scheduler.counters.prefix_cache_queries}" for i in range(len(prompts))]
    for rid, prompt, lora in zip(rids, prompts, loras, strict=True):
        core.add_request(rid, prompt, params, lora_name=lora or "")
    tokens = {rid: [] for rid in rids}
    cached = {}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.req_id].extend(out.new_token_ids)
            cached[out.req_id] = out.num_cached_tokens
    return [(tokens[r], cached[r]) for r in rids]


# -- the kernel ---------------------------------------------------------------------------------------------


def _case(dtype: torch.dtype, rows: int, k: int, shards: list[int], slots: list[int], rank: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(shards)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    y = torch.randn(rows, n, generator=gen).to(dtype)
    a = (torch.randn(4, len(shards) * rank, k, generator=gen) * 0.3).to(dtype)
    bt = (torch.randn(4, rank, n, generator=gen) * 0.3).to(dtype)
    cols = [0]
    for size in shards:
        cols.append(cols[-1] + size)
    return y, x, a, bt, torch.tensor(slots, dtype=torch.int32), cols


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_lora_add_matches_the_reference(dtype):
    native = kernels.load()
    if native is None:
        pytest.skip("native kernels unavailable here")
    # Sizes off the vector width (k = 70, shards of 37/19/90 columns), base rows (-1) between adapters' rows.
    y, x, a, bt, slots, cols = _case(dtype, 9, 70, [37, 19, 90], [2, -1, 0, 2, 3, -1, 0, 2, 2])
    expected = y.clone()
    lora_add_reference(expected, x, a, bt, slots, cols)
    got = y.clone()
    native.lora_add(got, x, a, bt, slots, cols)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    base = slots < 0
    assert torch.equal(got[base], y[base])  # rows of the base model untouched
    assert not torch.allclose(got[~base].float(), y[~base].float())


def test_native_lora_add_row_does_not_depend_on_its_batch():
    native = kernels.load()
    if native is None:
        pytest.skip("native kernels unavailable here")
    y, x, a, bt, slots, cols = _case(torch.float32, 7, 64, [64, 32], [1, 1, 1, 1, 1, 3, 0])
    together = y.clone()
    native.lora_add(together, x, a, bt, slots, cols)
    for t in range(7):
        alone = y[t : t + 1].clone()
        native.lora_add(alone, x[t : t + 1].contiguous(), a, bt, slots[t : t + 1].contiguous(), cols)
        assert torch.equal(alone[0], together[t])


def test_native_lora_add_refuses_bad_shapes():
    native = kernels.load()
    if native is None:
        pytest.skip("native kernels unavailable here")
    y, x, a, bt, slots, cols = _case(torch.float32, 3, 16, [8, 8], [0, 1, 9])
    with pytest.raises(RuntimeError, match="slot 9"):
        native.lora_add(y, x, a, bt, slots, cols)
    with pytest.raises(RuntimeError, match="shard_cols"):
        native.lora_add(y, x, a, bt, torch.zeros(3, dtype=torch.int32), [0, 16])


# -- against HF transformers + PEFT --------------------------------------------------------------------------


def _checkpoint(arch: str, root: Path) -> tuple[Path, dict[str, Path]]:
    base = make_tiny_checkpoint(arch, root / "base")
    adapters = {name: make_peft_adapter(base, root / name, rank, targets, seed=i + 1)
                for i, (name, rank, targets) in enumerate(ADAPTERS)}
    return base, adapters


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return _checkpoint(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    return _checkpoint("llama", tmp_path_factory.mktemp("lora-llama"))


def test_greedy_tokens_equal_hf_peft_with_adapters_and_base_in_one_batch(checkpoint):
    base, adapters = checkpoint
    reference = PeftReference(base, adapters)
    modules = [f"{name}={path}" for name, path in adapters.items()]
    # max_loras 2 < 3 adapters: the scheduler holds a third adapter's requests back a step, slots are reused.
    core = engine(base, max_loras=2, max_lora_rank=16, lora_modules=modules, max_num_seqs=16)
    runs = [(prompt, name) for prompt in PROMPTS for name in [None, *adapters]]
    outs = generate(core, [p for p, _ in runs], GREEDY, [n for _, n in runs])
    got = {(tuple(p), n): tokens for (p, n), (tokens, _) in zip(runs, outs, strict=True)}
    for prompt, name in runs:
        assert got[(tuple(prompt), name)] == reference.greedy(prompt, GREEDY.max_tokens, name), (name, prompt)
    for prompt in PROMPTS:  # the adapters do change the tokens: the comparison above can fail
        assert len({tuple(got[(tuple(prompt), n)]) for n in [None, *adapters]}) == 4
    stats = core.lora.stats
    assert stats.slot_loads >= 3 and stats.slot_evictions >= 1


# -- block hashes ----------------------------------------------------------------------------------------------


def test_block_hashes_are_per_adapter():
    tokens = list(range(64))
    base = prompt_block_hashes(tokens, "m", 16)
    a = prompt_block_hashes(tokens, "m", 16, lora_name="a")
    b = prompt_block_hashes(tokens, "m", 16, lora_name="b")
    assert prompt_block_hashes(tokens, "m", 16, lora_name="a") == a
    assert len(set(base + a + b)) == 12
    kv = KVCacheManager(BlockPool(16), 16, "m")
    req = Request("r", tokens, SamplingParams(), lora_name="a")
    kv.update_block_hashes(req)
    assert req.block_hashes == a  # the engine hashes as the gateway routes


def test_a_prefix_cached_under_one_adapter_is_no_hit_for_another_or_the_base(llama_checkpoint):
    base, adapters = llama_checkpoint
    core = engine(base, max_loras=2, max_lora_rank=16, lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    prompt = list(range(10, 60))  # three full blocks
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def cached(lora: str | None) -> int:
        return generate(core, [prompt], params, [lora])[0][1]

    assert cached("all8") == 0
    assert cached("attn4") == 0
    assert cached(None) == 0
    assert cached("all8") == 48 and cached("attn4") == 48 and cached(None) == 48


# -- more adapters than slots and memory ---------------------------------------------------------------------


def test_32_adapters_through_8_slots_all_served_and_evictions_counted(llama_checkpoint, tmp_path):
    base, adapters = llama_checkpoint
    template = adapters["attn4"]
    paths = {}
    for i in range(32):  # 32 distinct adapters (copies with their own weights scaled differently)
        folder = tmp_path / f"a{i}"
        shutil.copytree(template, folder)
        paths[f"a{i}"] = folder
        config = json.loads((folder / "adapter_config.json").read_text())
        config["lora_alpha"] = config["r"] * (0.5 + i / 16)
        (folder / "adapter_config.json").write_text(json.dumps(config))
    core = engine(base, blocks=256, max_loras=8, max_cpu_loras=8, max_lora_rank=16, max_num_seqs=64,
                  lora_modules=[f"{n}={p}" for n, p in paths.items()])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    names = list(paths)
    outs = generate(core, [PROMPTS[1]] * 32, params, names)
    assert all(len(tokens) == 4 for tokens, _ in outs)
    stats = core.lora.stats
    assert stats.slot_evictions >= 24 and stats.cpu_evictions >= 24
    assert stats.loads >= 32 + 24  # read at start, and again after falling out of memory
    # Batched through the slots as run alone: the same tokens.
    for i in (0, 13, 31):
        assert generate(core, [PROMPTS[1]], params, [names[i]])[0][0] == outs[i][0]


def test_scheduler_runs_at_most_max_loras_adapters_per_step():
    kv = KVCacheManager(BlockPool(64), 16, "m")
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512), kv, 256, max_loras=2)
    for i, name in enumerate(["a", "b", "c", "", "a", "c"]):
        sched.add_request(Request(f"r{i}", list(range(20)), SamplingParams(max_tokens=3, ignore_eos=True),
                                  lora_name=name))
    lora_of = {f"r{i}": n for i, n in enumerate(["a", "b", "c", "", "a", "c"])}
    seen_together, finished = [], set()
    for _ in range(20):
        out = sched.schedule()
        adapters = {lora_of[r] for r in out.num_scheduled_tokens} - {""}
        assert len(adapters) <= 2
        seen_together.append(adapters)
        result = ModelRunnerOutput(sampled_token_ids={r: (7,) for r in out.num_scheduled_tokens})
        finished |= {o.req_id for o in sched.update_from_output(out, result) if o.finish_reason}
        if not sched.has_unfinished():
            break
    assert finished == set(lora_of)
    assert {"a", "b"} in seen_together and any("c" in s for s in seen_together)


# -- what is refused ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-refusals")
    base = make_tiny_checkpoint("llama", root / "base")
    return engine(base, blocks=32, max_loras=1, max_lora_rank=8), base, root


def _broken(root: Path, base: Path, name: str, rank: int = 4, targets=("q_proj",), edit=None, **kw) -> Path:
    folder = make_peft_adapter(base, root / name, rank, targets, **kw)
    if edit is not None:
        edit(folder)
    return folder


@pytest.mark.parametrize("case, message", [
    ("missing", "no adapter_model.safetensors"),
    ("rank", "rank 16 exceeds this node's --max-lora-rank 8"),
    ("config_rank", "r=2"),
    ("target", "targets 'lm_head'"),
    ("dora", "use_dora=True is not supported"),
    ("shape", "the model's q_proj maps 64 -> 64"),
])
def test_malformed_adapters_are_refused_with_a_clear_message(small_engine, case, message, tmp_path):
    core, base, _ = small_engine
    if case == "missing":
        folder = _broken(tmp_path, base, case, edit=lambda f: (f / "adapter_model.safetensors").unlink())
    elif case == "rank":
        folder = _broken(tmp_path, base, case, rank=16)
    elif case == "config_rank":
        def edit(f):
            config = json.loads((f / "adapter_config.json").read_text())
            (f / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
        folder = _broken(tmp_path, base, case, edit=edit)
    elif case == "target":
        folder = _broken(tmp_path, base, case, targets=("q_proj", "lm_head"))
    elif case == "dora":
        folder = _broken(tmp_path, base, case, use_dora=True)
    else:
        other = make_tiny_checkpoint("llama", tmp_path / "other", hidden_size=32, num_attention_heads=2)
        folder = make_peft_adapter(other, tmp_path / case, 4, ("q_proj",))
    with pytest.raises(AdapterError, match=message.replace("(", r"\(")):
        core.read_lora("bad", str(folder))
    assert core.lora.names() == []  # nothing registered; the engine still serves
    assert len(generate(core, [PROMPTS[1]], GREEDY, [None])[0][0]) == GREEDY.max_tokens


def test_unknown_adapter_is_refused_and_unload_waits_for_nothing_left(small_engine):
    engine, base, root = small_engine
    with pytest.raises(UnknownAdapter, match="does not exist"):
        engine.add_request("r0", PROMPTS[1], GREEDY, lora_name="nope")
    folder = make_peft_adapter(base, root / "ok", 4, ("q_proj", "down_proj"))
    engine.add_lora("ok", engine.read_lora("ok", f"file://{folder}"))
    engine.add_request("r1", PROMPTS[1], GREEDY, lora_name="ok")
    engine.begin_unload_lora("ok")
    assert engine.lora_in_use("ok") == 1  # running requests finish with it...
    with pytest.raises(UnknownAdapter):  # ...while new ones are refused
        engine.add_request("r2", PROMPTS[1], GREEDY, lora_name="ok")
    while engine.has_unfinished():
        engine.step()
    assert engine.lora_in_use("ok") == 0 and engine.remove_lora("ok") and engine.lora.names() == []


def test_lora_config_checks_and_module_forms():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == (("a", "/x"), ("b", "/y"))
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["nopath"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="given twice"):
        LoRAConfig(enable_lora=True, lora_modules=(("a", "/x"), ("a", "/y")))


def test_llm_generate_takes_vllm_lora_requests(default_model_dir, tmp_path):
    base = make_tiny_with_tokenizer(tmp_path / "base", Path(default_model_dir))
    folder = make_peft_adapter(base, tmp_path / "a", 4, ("q_proj", "v_proj"), scale=0.5)
    llm = LLM(model=str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_gpu_blocks_override=32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain, tuned = llm.generate(["a prompt", "a prompt"], params, use_tqdm=False,
                                lora_request=[None, LoRARequest("a", 1, str(folder))])
    assert llm.engine.lora.names() == ["a"]  # read from its path on first use
    assert plain.outputs[0].token_ids != tuned.outputs[0].token_ids
    again = llm.generate("a prompt", params, use_tqdm=False, lora_request=LoRARequest("a", 1))
    assert again[0].outputs[0].token_ids == tuned.outputs[0].token_ids
