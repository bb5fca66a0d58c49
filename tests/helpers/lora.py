"""Random LoRA adapters in the PEFT format for tests, written by PEFT itself, and HF transformers + PEFT greedy
decoding as the reference the engine is compared with.

`make_peft_adapter(base_dir, path, rank, targets, seed)` wraps the base checkpoint with PEFT, draws every LoRA
weight at a scale where a wrong update visibly changes the tokens (PEFT's own init leaves B zero, which would
hide everything), and saves adapter_config.json + adapter_model.safetensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base_dir: str | Path, path: str | Path, rank: int, targets: Sequence[str] = ALL_TARGETS,
                      seed: int = 0, alpha: float | None = None, scale: float = 0.1, **lora_config) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=rank if alpha is None else alpha, target_modules=list(targets),
                        lora_dropout=0.0, init_lora_weights=False, **lora_config)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    path = Path(path)
    model.save_pretrained(str(path))
    return path


class PeftReference:
    """The base model with every adapter loaded in PEFT; `greedy(prompt, n, adapter)` (None: the base model)."""

    def __init__(self, base_dir: str | Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        items = list(adapters.items())
        self.model = PeftModel.from_pretrained(base, str(items[0][1]), adapter_name=items[0][0])
        for name, folder in items[1:]:
            self.model.load_adapter(str(folder), adapter_name=name)
        self.model.eval()

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int, adapter: str | None) -> list[int]:
        """n greedy tokens (an end token does not stop it), over HF's KV cache."""
        if adapter is None:
            with self.model.disable_adapter():
                return self._greedy(prompt, n)
        self.model.set_adapter(adapter)
        return self._greedy(prompt, n)

    def _greedy(self, prompt: list[int], n: int) -> list[int]:
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        while len(tokens) < n:
            out = self.model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                             use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens


def tiny_with_tokenizer(arch: str, path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of `arch` (tests.helpers.models) over the default model's tokenizer (49152 tokens),
    so the gateway can serve it: text round-trips and chat templates render."""
    import shutil

    from tests.helpers.models import TOKENIZER_FILES, make_tiny_checkpoint

    make_tiny_checkpoint(arch, path, seed=seed, vocab_size=49152, max_position_embeddings=2048)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path
