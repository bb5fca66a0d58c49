"""kvrelay: disaggregated LLM serving. An OpenAI-compatible gateway in front of a prefill pool and a decode
pool of engines, each with its own paged KV cache and scheduler, handing KV caches between them.

One import root over the repository's folders (pyproject.toml maps them):

    kvrelay.common        the contracts every part shares (block hash, records, protobuf conversion, ...)
    kvrelay.model_files   model folders and GGUF conversion
    kvrelay.engine        the engine: scheduler, KV cache, model runner, sampler  (shared/engine)
    kvrelay.index         the block index and node registry in Redis               (shared/index)
    kvrelay.kv_transfer   KV transfer connectors: shm, UCX, NCCL                   (kv_transfer/)
    kvrelay.node          what every node process runs                             (shared/node)
    kvrelay.prefill_node  kvrelay.decode_node  kvrelay.gateway   the roles         (prefill_node/ ...)
    kvrelay.bench         benchmarks;  kvrelay.cli   the `kvrelay` command
"""

__version__ = "0.1.0"
