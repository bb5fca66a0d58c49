"""Time models: what a step, a KV transfer and a node start take, read from a profile (a JSON file).

A step is described by its shape (`StepShape`): the tokens it computes, its rows (requests), the query-key
pairs of its prefill chunks, and the context its decode rows read. Two step models:

- `linear` (a calibrated machine, `kvrelay sim calibrate`): t = intercept + per_token * tokens + per_row * rows
  + per_tile_pass * ceil(tokens / tile_rows) + per_prefill_pair * prefill_pairs + per_decode_context *
  decode_context, fitted by least squares to measured steps of the real engine, one fit per CPU thread count.
  The tile passes are the CPU GEMM's: it computes a step's tokens in register tiles of a few rows (6 with
  AVX-512), each tile reading every weight again, so one to six decode rows cost nearly the same and a seventh
  costs a second pass (measured: 17.5 ms at 6 rows, 23.2 ms at 8, one thread). Calibration picks the tile rows
  that fit best. On top, what serving adds (`kvrelay sim calibrate` measures it on a real fleet of that
  placement): `served_step_s + served_row_s * min(rows, SERVED_ROWS)` per step (streaming each step's tokens
  through the node's RPCs, the gateway and the client takes CPU from the engine's threads; the row term is
  measured up to SERVED_ROWS rows and not extrapolated past them), and `request_overhead_s` per request (the
  gateway's HTTP and routing work, its RPCs, waking an idle node);
- `roofline` (a GPU we cannot measure here): t = overhead + max(FLOPs / (peak x efficiency), bytes /
  (bandwidth x efficiency)) + tensor-parallel all-reduces, from the model's shape and the GPU's datasheet.

A KV transfer takes per_request_s + bytes / bandwidth (same host or network). Each profile says which of its
figures were measured and which were modelled (`figures`). Profiles ship in shared/sim/profiles/; `local` is
the one `kvrelay sim calibrate` wrote for this machine.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar, NamedTuple

from kvrelay.common.system import cache_dir

PROFILES_DIR = Path(__file__).parent / "profiles"


def local_profile_path() -> Path:
    return Path(os.environ.get("KVRELAY_SIM_PROFILE") or Path(cache_dir()) / "sim" / "local.json")


class StepShape(NamedTuple):
    """A named tuple: one is made per simulated step."""

    tokens: int = 0  # tokens computed this step
    rows: int = 0  # requests in the step
    prefill_tokens: int = 0  # of `tokens`, those in chunks of more than one token
    prefill_pairs: float = 0.0  # sum over prefill chunks of n * (context before + (n + 1) / 2): query-key pairs
    prefill_context: int = 0  # sum over prefill chunks of the context they end with (KV read once per chunk)
    decode_context: int = 0  # sum over decode rows (one token) of the context they attend to

    @classmethod
    def of(cls, chunks) -> StepShape:
        """From (tokens scheduled, tokens computed before) per request."""
        tokens = rows = ptok = pctx = dctx = 0
        pairs = 0.0
        for n, ctx in chunks:
            tokens += n
            rows += 1
            if n == 1:
                dctx += ctx + 1
            else:
                ptok += n
                pctx += ctx + n
                pairs += n * (ctx + (n + 1) / 2)
        return tuple.__new__(cls, (tokens, rows, ptok, pairs, pctx, dctx))


def step_shape(sched, requests) -> StepShape:
    """The shape of a scheduled step (a SchedulerOutput, after schedule() counted its tokens as computed)."""
    return StepShape.of((n, requests[rid].num_computed_tokens - n) for rid, n in sched.num_scheduled_tokens.items())


SERVED_ROWS = 8  # streams at once when calibration measures what serving adds per row (calibrate_served)
LINEAR_TERMS = ("intercept_s", "per_token_s", "per_row_s", "per_prefill_pair_s", "per_decode_context_s",
                "per_tile_pass_s")


def tile_passes(tokens: int, tile_rows: int) -> int:
    """Passes of the GEMM's register tiles of `tile_rows` rows over the weights for `tokens` rows (0: no tiles)."""
    return -(-tokens // tile_rows) if tile_rows else 0


def linear_features(s: StepShape, tile_rows: int = 0) -> tuple[float, ...]:
    return (1.0, s.tokens, s.rows, s.prefill_pairs, s.decode_context, tile_passes(s.tokens, tile_rows))


@dataclass(frozen=True)
class LinearStep:
    intercept_s: float
    per_token_s: float
    per_row_s: float
    per_prefill_pair_s: float
    per_decode_context_s: float
    # What serving adds (none: the engine alone), measured apart from the fit.
    served_step_s: float = 0.0
    served_row_s: float = 0.0
    request_overhead_s: float = 0.0  # on each request's way in
    per_tile_pass_s: float = 0.0  # per pass of the GEMM's register tiles over the weights
    tile_rows: int = 0  # rows per tile (0: no pass term)

    def time(self, s: StepShape) -> float:
        rows = s.rows
        t = (self.intercept_s + self.served_step_s + self.per_token_s * s.tokens + self.per_row_s * rows
             + self.served_row_s * (rows if rows < SERVED_ROWS else SERVED_ROWS)
             + self.per_prefill_pair_s * s.prefill_pairs + self.per_decode_context_s * s.decode_context)
        return t + self.per_tile_pass_s * tile_passes(s.tokens, self.tile_rows)

    def engine_only(self) -> LinearStep:
        """The fitted engine step, without what serving adds."""
        return replace(self, served_step_s=0.0, served_row_s=0.0, request_overhead_s=0.0)


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    params: float  # weights, embeddings included
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class RooflineStep:
    model: ModelShape
    tensor_parallel: int
    peak_flops: float  # per GPU, dense, in the model's dtype
    hbm_bytes_per_s: float  # per GPU
    link_bytes_per_s: float  # GPU-to-GPU (NVLink), per direction
    compute_efficiency: float
    memory_efficiency: float
    overhead_s: float  # per step: scheduling, launches, sampling
    allreduce_latency_s: float  # per all-reduce (two per layer under tensor parallelism)
    request_overhead_s: ClassVar[float] = 0.0  # as LinearStep's: none modelled beyond the fleet's hops
    # The factors of `time` that do not depend on the step, worked out once (a simulation asks for every step).
    _factors: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m, tp = self.model, self.tensor_parallel
        embed = m.vocab_size * m.hidden_size
        object.__setattr__(self, "_factors", (
            2 * (m.params - embed), 2 * embed, 4 * m.num_layers * m.num_heads * m.head_size, m.weight_bytes,
            m.kv_bytes_per_token, tp * self.peak_flops * self.compute_efficiency,
            tp * self.hbm_bytes_per_s * self.memory_efficiency, 2 * (tp - 1) / tp))

    def time(self, s: StepShape) -> float:
        per_token, per_row, per_pair, weight_bytes, kv_bytes, flops_per_s, bytes_per_s, ring = self._factors
        flops = per_token * s.tokens + per_row * s.rows + per_pair * (s.prefill_pairs + s.decode_context)
        memory = (weight_bytes + kv_bytes * (s.decode_context + s.prefill_context + s.tokens)) / bytes_per_s
        compute = flops / flops_per_s
        comm = 0.0
        if self.tensor_parallel > 1:
            m = self.model
            per = self.allreduce_latency_s + ring * s.tokens * m.hidden_size * m.dtype_bytes / self.link_bytes_per_s
            comm = 2 * m.num_layers * per
        return self.overhead_s + max(compute, memory) + comm


@dataclass(frozen=True)
class TransferModel:
    """KV transfer: per_request_s + bytes / bandwidth."""

    same_host_bytes_per_s: float
    network_bytes_per_s: float
    per_request_s: float

    def time(self, nbytes: float, same_host: bool) -> float:
        bw = self.same_host_bytes_per_s if same_host else self.network_bytes_per_s
        return self.per_request_s + nbytes / bw


@dataclass(frozen=True)
class Profile:
    """One node's hardware and model, as the simulator needs it."""

    name: str
    description: str
    source: str  # "calibrated" | "roofline"
    model: ModelShape
    kv_cache_blocks: int  # per node
    block_size: int
    startup_s: float  # from start to serving (planner)
    transfer: TransferModel
    steps: dict[int, LinearStep | RooflineStep]  # by CPU threads per node (a GPU profile: one, keyed 0)
    single_host: bool = False  # every node on one machine: KV moves on the same-host path (else the network)
    gpus_per_node: int = 0
    machine: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)  # {"measured": [...], "modelled": [...]}
    fit: dict = field(default_factory=dict)  # a calibration's fit quality

    def step_model(self, threads: int | None = None) -> LinearStep | RooflineStep:
        if threads is None or threads not in self.steps:
            if threads is not None and len(self.steps) > 1:
                raise ValueError(f"profile {self.name}: no step model for {threads} threads "
                                 f"(it has {sorted(self.steps)})")
            return self.steps[max(self.steps)]
        return self.steps[threads]

    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_token * self.block_size

    def to_json(self) -> dict:
        out = asdict(self)
        out["steps"] = {str(k): {"kind": "linear" if isinstance(v, LinearStep) else "roofline",
                                 **{f: x for f, x in asdict(v).items() if f not in ("model", "_factors")}}
                        for k, v in self.steps.items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        model = ModelShape(**data["model"])
        steps: dict[int, LinearStep | RooflineStep] = {}
        for key, raw in data["steps"].items():
            raw = dict(raw)
            kind = raw.pop("kind")
            steps[int(key)] = LinearStep(**raw) if kind == "linear" else RooflineStep(model=model, **raw)
        return cls(name=data["name"], description=data["description"], source=data["source"], model=model,
                   kv_cache_blocks=int(data["kv_cache_blocks"]), block_size=int(data["block_size"]),
                   startup_s=float(data["startup_s"]), transfer=TransferModel(**data["transfer"]), steps=steps,
                   single_host=bool(data.get("single_host", False)), gpus_per_node=int(data.get("gpus_per_node", 0)),
                   machine=data.get("machine", {}), figures=data.get("figures", {}), fit=data.get("fit", {}))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def load_profile(name_or_path: str) -> Profile:
    """`local` (this machine, calibrated), a shipped name (`h100`, `h200`, ...), or a JSON file."""
    if name_or_path == "local":
        path = local_profile_path()
        if not path.is_file():
            raise ValueError(f"profile local: {path} does not exist; run `kvrelay sim calibrate` first (or use "
                             f"one of {shipped_profiles()})")
    elif (PROFILES_DIR / f"{name_or_path}.json").is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"profile: {name_or_path!r} is neither a file nor one of local, "
                             f"{', '.join(shipped_profiles())}")
    return Profile.from_json(json.loads(path.read_text()))


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
