"""The engine every node runs: the vLLM design on PyTorch.

    EngineCore (core.py)        schedule() -> execute() -> update(), one step at a time
    Scheduler (scheduler.py)    ids and counts: token budget, chunked prefill, prefix hits, preemption
    KVCacheManager, BlockPool   paged KV blocks, ref counts, the prefix cache's hash map and LRU
    ModelRunner (model_runner)  one flat forward pass over the paged cache, then the sampler
    models/, attention/         model implementations and attention backends
    AsyncEngine                 the EngineCore on its own thread, behind an asyncio API (what nodes run)
    LLM (llm.py)                offline inference

It imports nothing of the node runtime, the index, KV transfer or the roles (checked by import-linter).
"""
