"""Roofline profiles for GPUs this project cannot measure: the shipped `h100` and `h200` profiles are
`roofline_profile(H100)` and `roofline_profile(H200)` written to shared/sim/profiles/ (a test checks that the
files are what this module computes, so they never drift from the stated assumptions).

A node is 2 GPUs at tensor parallelism 2 serving a Qwen3-32B-shaped model in bf16: the shape of llm-d's
precise-prefix benchmark (8 pods of 2 H100). What is taken from datasheets and model cards, and what is an
assumption, is listed in each profile's `figures`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.common.hashing import DEFAULT_BLOCK_SIZE
from kvrelay.sim.timemodel import PROFILES_DIR, ModelShape, Profile, RooflineStep, TransferModel


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    peak_bf16_flops: float  # dense
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per direction


H100 = GPU("NVIDIA H100 SXM5 80GB", 80e9, 989.4e12, 3.35e12, 450e9)
H200 = GPU("NVIDIA H200 SXM 141GB", 141e9, 989.4e12, 4.8e12, 450e9)

# Qwen3-32B's config.json: 64 layers, hidden 5120, 64 query heads, 8 KV heads of 128, vocabulary 151,936,
# 32.8 B parameters.
QWEN3_32B = ModelShape(name="Qwen3-32B (shape)", num_layers=64, hidden_size=5120, num_heads=64, num_kv_heads=8,
                       head_size=128, params=32.8e9, vocab_size=151_936, dtype_bytes=2)

# Assumptions (modelled, not measured):
COMPUTE_EFFICIENCY = 0.55  # share of peak FLOP/s a large prefill reaches (vLLM-class kernels)
MEMORY_EFFICIENCY = 0.75  # share of HBM bandwidth a decode step's weight and KV reads reach
STEP_OVERHEAD_S = 0.003  # per step: scheduling, launches (CUDA graphs), sampling
ALLREDUCE_LATENCY_S = 10e-6  # one small NCCL all-reduce over NVLink
MEMORY_UTILIZATION = 0.9  # of each GPU's memory for weights + KV (gpu_memory_utilization)
ACTIVATION_RESERVE = 4e9  # per GPU: activations, CUDA graphs, the sampler's buffers
NETWORK_BYTES_PER_S = 80e9  # a 2-GPU node's 2 x 400 Gb/s RDMA NICs at 80% of line rate
TRANSFER_OVERHEAD_S = 0.002  # per request: the hand-off's RPCs and RDMA set-up
STARTUP_S = 75.0  # pod start to serving: image cached, 66 GB of weights at ~2 GB/s, graph capture, warm-up


def roofline_profile(name: str, gpu: GPU, model: ModelShape = QWEN3_32B, tp: int = 2,
                     block_size: int = DEFAULT_BLOCK_SIZE) -> Profile:
    kv_bytes = gpu.memory_bytes * tp * MEMORY_UTILIZATION - model.weight_bytes - ACTIVATION_RESERVE * tp
    blocks = int(kv_bytes // (model.kv_bytes_per_token * block_size))
    step = RooflineStep(model=model, tensor_parallel=tp, peak_flops=gpu.peak_bf16_flops,
                        hbm_bytes_per_s=gpu.hbm_bytes_per_s, link_bytes_per_s=gpu.nvlink_bytes_per_s,
                        compute_efficiency=COMPUTE_EFFICIENCY, memory_efficiency=MEMORY_EFFICIENCY,
                        overhead_s=STEP_OVERHEAD_S, allreduce_latency_s=ALLREDUCE_LATENCY_S)
    return Profile(
        name=name, source="roofline",
        description=f"{tp}x {gpu.name} per node (tensor parallel {tp}), {model.name} in bf16; roofline model",
        model=model, kv_cache_blocks=blocks, block_size=block_size, startup_s=STARTUP_S,
        transfer=TransferModel(same_host_bytes_per_s=gpu.nvlink_bytes_per_s * 0.8,
                               network_bytes_per_s=NETWORK_BYTES_PER_S, per_request_s=TRANSFER_OVERHEAD_S),
        steps={0: step}, single_host=False, gpus_per_node=tp,
        machine={"gpu": gpu.name, "gpus_per_node": tp},
        figures={
            "measured": [],
            "datasheet": [f"peak bf16 dense {gpu.peak_bf16_flops / 1e12:.1f} TFLOP/s",
                          f"HBM {gpu.hbm_bytes_per_s / 1e12:.2f} TB/s", f"memory {gpu.memory_bytes / 1e9:.0f} GB",
                          f"NVLink {gpu.nvlink_bytes_per_s / 1e9:.0f} GB/s per direction",
                          f"model shape: {model.name}"],
            "modelled": [f"compute efficiency {COMPUTE_EFFICIENCY}", f"memory efficiency {MEMORY_EFFICIENCY}",
                         f"step overhead {STEP_OVERHEAD_S * 1e3:g} ms",
                         f"all-reduce latency {ALLREDUCE_LATENCY_S * 1e6:g} us",
                         f"KV cache: {MEMORY_UTILIZATION} of memory less weights and "
                         f"{ACTIVATION_RESERVE / 1e9:g} GB per GPU = {blocks} blocks",
                         f"network {NETWORK_BYTES_PER_S / 1e9:g} GB/s, {TRANSFER_OVERHEAD_S * 1e3:g} ms per transfer",
                         f"start-up {STARTUP_S:g} s"],
        },
    )


SHIPPED = {"h100": H100, "h200": H200}


def write_shipped() -> list[str]:
    """(Re)write the shipped GPU profiles; returns their paths."""
    return [str(roofline_profile(name, gpu).save(PROFILES_DIR / f"{name}.json")) for name, gpu in SHIPPED.items()]


if __name__ == "__main__":  # python -m kvrelay.sim.gpus: rewrite the shipped profiles from these assumptions
    print("\n".join(write_shipped()))
