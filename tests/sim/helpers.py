"""A tiny profile whose step times are easy to compute by hand: a step takes 10 ms plus 1 ms per token."""

from __future__ import annotations

from kvrelay.sim.timemodel import LinearStep, ModelShape, Profile, TransferModel

TINY_MODEL = ModelShape("tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_size=16, params=1e6,
                        vocab_size=50_000, dtype_bytes=2)  # 256 bytes of KV per token, 4,096 per block


def tiny_profile(blocks: int = 1000, intercept_s: float = 0.01, per_token_s: float = 0.001) -> Profile:
    return Profile(name="tiny", description="hand-computable", source="calibrated", model=TINY_MODEL,
                   kv_cache_blocks=blocks, block_size=16, startup_s=2.0,
                   transfer=TransferModel(same_host_bytes_per_s=1e9, network_bytes_per_s=1e9, per_request_s=0.001),
                   steps={1: LinearStep(intercept_s, per_token_s, 0.0, 0.0, 0.0)}, single_host=True)
