"""The trace format of `kvrelay sim` and `kvrelay plan`: JSONL, one request per line (docs/fleet.md).

    {"arrival_s": 0.52, "prefix_group": "tenant-7", "prefix_len": 6000, "suffix_len": 1200, "output_len": 1000,
     "tenant": "tenant-7"}
    {"arrival_s": 0.61, "prompt_tokens": [1, 2, 3], "output_len": 16, "session": "s-3"}

A prompt is either its tokens, or a shared-prefix group with a unique suffix: every group names a token stream,
and a request's prompt is the first `prefix_len` tokens of its group's stream followed by `suffix_len` tokens no
other request has (keyed by the request's line in the trace). Optional: `tenant`, `session`, `model`, and
`output_tokens`, what the simulated model answers (default: see `PromptSource.output_tokens`).

Token ids are drawn from [1000, 40000), inside every vocabulary kvrelay serves (the default model's is 49,152),
so a trace replays against a real fleet as it is (`kvrelay sim validate`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

TOKEN_LOW, TOKEN_HIGH = 1000, 40000
_CHUNK = 4096  # a group's stream is generated in chunks, so any prefix of it is the same whoever asks first


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    output_len: int
    prompt_tokens: tuple[int, ...] | None = None
    prefix_group: str | None = None
    prefix_len: int = 0
    suffix_len: int = 0
    tenant: str | None = None
    session: str | None = None
    model: str | None = None
    output_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"arrival_s: must be >= 0, got {self.arrival_s}")
        if self.output_len < 1:
            raise ValueError(f"output_len: must be >= 1, got {self.output_len}")
        if (self.prompt_tokens is None) == (self.prefix_group is None):
            raise ValueError("a request needs either prompt_tokens or prefix_group (with prefix_len, suffix_len)")
        if self.prefix_group is not None and (self.prefix_len < 0 or self.suffix_len < 0
                                              or self.prefix_len + self.suffix_len < 1):
            raise ValueError(f"prefix_len, suffix_len: need >= 0 and a prompt of >= 1 token, got "
                             f"{self.prefix_len}, {self.suffix_len}")
        if self.prompt_tokens is not None and not self.prompt_tokens:
            raise ValueError("prompt_tokens: must not be empty")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens) if self.prompt_tokens is not None else self.prefix_len + self.suffix_len

    def to_json(self) -> dict:
        out: dict = {"arrival_s": round(self.arrival_s, 6)}
        if self.prompt_tokens is not None:
            out["prompt_tokens"] = list(self.prompt_tokens)
        else:
            out.update(prefix_group=self.prefix_group, prefix_len=self.prefix_len, suffix_len=self.suffix_len)
        out["output_len"] = self.output_len
        for key in ("tenant", "session", "model"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.output_tokens is not None:
            out["output_tokens"] = list(self.output_tokens)
        return out

    @classmethod
    def from_json(cls, data: dict) -> TraceRequest:
        known = {"arrival_s", "output_len", "prompt_tokens", "prefix_group", "prefix_len", "suffix_len", "tenant",
                 "session", "model", "output_tokens"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown trace fields {unknown} (known: {sorted(known)})")
        values = dict(data)
        for key in ("prompt_tokens", "output_tokens"):
            if values.get(key) is not None:
                values[key] = tuple(int(t) for t in values[key])
        values["arrival_s"] = float(values["arrival_s"])
        return cls(**values)


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a JSONL trace, sorted by arrival (stable: equal arrivals keep their order)."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(TraceRequest.from_json(json.loads(line)))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    out.sort(key=lambda r: r.arrival_s)
    return out


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for req in requests:
            f.write(json.dumps(req.to_json(), separators=(",", ":")) + "\n")
    return path


def _tokens(key: str, n: int) -> list[int]:
    rng = np.random.default_rng(xxhash.xxh64_intdigest(key.encode()))
    return rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n).tolist()


class PromptSource:
    """Turns trace requests into token ids: group streams are built once and shared (a long-prefix workload of
    150 groups holds 150 streams, not one copy per request)."""

    def __init__(self, salt: str = "") -> None:
        self.salt = salt
        self._streams: dict[str, list[int]] = {}

    def stream(self, group: str, n: int) -> list[int]:
        """At least the first n tokens of a group's stream (the shared list itself: slice it, do not modify it)."""
        tokens = self._streams.get(group)
        if tokens is None:
            tokens = self._streams[group] = []
        while len(tokens) < n:
            tokens.extend(_tokens(f"{self.salt}group\x00{group}\x00{len(tokens) // _CHUNK}", _CHUNK))
        return tokens

    def prompt(self, index: int, req: TraceRequest) -> list[int]:
        """The prompt of the trace's request number `index`."""
        if req.prompt_tokens is not None:
            return list(req.prompt_tokens)
        prompt = self.stream(req.prefix_group, req.prefix_len)[: req.prefix_len]
        if req.suffix_len:
            prompt.extend(_tokens(f"{self.salt}suffix\x00{index}", req.suffix_len))
        return prompt

    def output_tokens(self, index: int, req: TraceRequest) -> list[int]:
        """What the simulated model answers: `output_tokens` when the trace gives them; for a prompt that is a
        group prefix and nothing else, the group's stream goes on (so a chat's next turn, a longer prefix of the
        same stream, finds this answer in the cache as a real conversation finds the assistant's reply); else
        tokens of its own."""
        n = req.output_len
        if req.output_tokens is not None:
            out = list(req.output_tokens[:n])
            return out + _tokens(f"{self.salt}out\x00{index}", n - len(out)) if len(out) < n else out
        if req.prefix_group is not None and not req.suffix_len:
            end = req.prefix_len + n
            return self.stream(req.prefix_group, end)[req.prefix_len:end]
        return _tokens(f"{self.salt}out\x00{index}", n)


def iter_groups(requests: Iterable[TraceRequest]) -> Iterator[str]:
    seen: set[str] = set()
    for r in requests:
        if r.prefix_group is not None and r.prefix_group not in seen:
            seen.add(r.prefix_group)
            yield r.prefix_group
