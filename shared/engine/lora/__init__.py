"""LoRA adapters in the engine (vLLM's --enable-lora): many adapters, and the base model, in one batch.

    adapter.py   reading and checking a PEFT adapter (adapter_config.json + adapter_model.safetensors)
    layers.py    a projection's adapter slots and the batched update of rows of different adapters
    manager.py   which adapters are known, held in memory and in slots (LRU), and the counts

The model runner asks the manager for each step's per-row slots and passes them to the model's forward; the
scheduler lets at most max_loras distinct adapters into one step; block hashes carry the adapter's name
(kvrelay.common.hashing.lora_extra_keys), so a cached prefix is shared within an adapter only.
"""

from kvrelay.engine.lora.adapter import AdapterError, LoRAAdapter, LoRARequest, read_adapter
from kvrelay.engine.lora.layers import LoRABatch, LoRAProjection, lora_add_reference
from kvrelay.engine.lora.manager import LoRAManager, LoRAStats, UnknownAdapter

__all__ = ["AdapterError", "LoRAAdapter", "LoRABatch", "LoRAManager", "LoRAProjection", "LoRARequest", "LoRAStats",
           "UnknownAdapter", "lora_add_reference", "read_adapter"]
