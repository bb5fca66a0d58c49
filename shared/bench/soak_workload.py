"""What `kvrelay bench soak` sends and how it judges each answer.

A request set mixes chat and completions, streamed and not, greedy, seeded and unseeded sampling, over
corpus prompts of 80-400 tokens; greedy and seeded answers are compared with their fault-free reference.
An answer is judged by what a client sees:
  ok         200 with the whole answer (a stream ending in [DONE], no error event);
  client     a 4xx other than 429 with an OpenAI error body (malformed requests expect this);
  rejected   429 or 503 with Retry-After and an OpenAI error body (overload, a fleet with no room);
  bad        anything else: another 5xx, a dropped connection, a stream without [DONE] or with an error.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import httpx

from kvrelay.bench.serve_datasets import TextSource

MALFORMED: list[tuple[str, object]] = [  # (endpoint, body): each must be a 4xx with an OpenAI error body
    ("chat", {"messages": [], "max_tokens": 4}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}),
    ("chat", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    ("completions", {"prompt": [10**9], "max_tokens": 4}),
    ("completions", b"{not json"),
]


@dataclass(frozen=True)
class SoakRequest:
    name: str
    endpoint: str  # "chat" | "completions"
    body: dict
    checked: bool  # greedy or seeded: the text must equal the fault-free reference

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Outcome:
    status: int  # 0: no HTTP answer (connection dropped or refused)
    text: str = ""
    error: str = ""
    retry_after: str | None = None
    error_body: bool = False  # an OpenAI-style {"error": {...}} body
    done: bool = True  # a stream ended with [DONE]
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        if self.status == 200:
            return "ok" if self.done and not self.error else "bad"
        if self.status in (429, 503):
            return "rejected" if self.retry_after and self.error_body else "bad"
        if 400 <= self.status < 500:
            return "client" if self.error_body else "bad"
        return "bad"


def build_requests(tokenizer, count: int, seed: int, max_tokens: int, min_input: int = 80,
                   max_input: int = 400, endpoints: tuple[str, ...] = ("chat", "completions")) -> list[SoakRequest]:
    """`count` requests cycling through every mix of endpoint x stream x sampling."""
    rng = random.Random(seed)
    source = TextSource(tokenizer)
    kinds = [(e, s, m) for m in ("greedy", "seeded", "random") for e in endpoints for s in (False, True)]
    out = []
    for i in range(count):
        endpoint, stream, mode = kinds[i % len(kinds)]
        text = source.window(rng, rng.randint(min_input, max_input))
        body: dict = {"max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
        body.update({"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 1000 + i},
                     "random": {"temperature": 0.8}}[mode])
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        out.append(SoakRequest(f"{i}-{endpoint}-{'stream' if stream else 'unary'}-{mode}", endpoint, body,
                               mode != "random"))
    return out


def send(client: httpx.Client, base_url: str, endpoint: str, body: object, timeout: float = 600.0) -> Outcome:
    url = f"{base_url}/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    stream = isinstance(body, dict) and body.get("stream")
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body,
                                                            "headers": {"content-type": "application/json"}}
    try:
        with client.stream("POST", url, timeout=timeout, **kwargs) as r:
            if r.status_code != 200 or not stream:
                r.read()
                return _unary(r, endpoint)
            return _stream(r, endpoint)
    except httpx.HTTPError as e:
        return Outcome(0, error=f"{type(e).__name__}: {e}", done=False)


def _unary(r: httpx.Response, endpoint: str) -> Outcome:
    out = Outcome(r.status_code, retry_after=r.headers.get("retry-after"))
    try:
        data = r.json()
    except ValueError:
        out.error = f"not JSON: {r.text[:200]}"
        return out
    if r.status_code != 200:
        err = data.get("error") if isinstance(data, dict) else None
        out.error_body = isinstance(err, dict) and bool(err.get("message")) and bool(err.get("type"))
        out.error = (err or {}).get("message", r.text[:200]) if isinstance(err, dict) else r.text[:200]
        return out
    choice = data["choices"][0]
    out.text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    return out


def _stream(r: httpx.Response, endpoint: str) -> Outcome:
    out = Outcome(200, done=False)
    parts = []
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out.done = True
            break
        msg = json.loads(line[6:])
        if "error" in msg:
            out.error = msg["error"].get("message", "stream error")
            continue
        for choice in msg.get("choices", ()):
            parts.append((choice.get("delta") or {}).get("content") or "" if endpoint == "chat" else choice["text"])
    out.text = "".join(parts)
    return out


@dataclass
class Tally:
    """Counts of verdicts, errors by message, and reference mismatches."""

    sent: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome, req: SoakRequest | None = None, reference: dict[str, str] | None = None) -> None:
        self.sent += 1
        verdict = outcome.verdict
        self.verdicts[verdict] = self.verdicts.get(verdict, 0) + 1
        if verdict != "ok" and verdict != "client":
            key = f"{outcome.status} {outcome.error[:120]}" + ("" if outcome.done else " (no [DONE])")
            self.errors[key] = self.errors.get(key, 0) + 1
        if verdict == "ok" and req is not None and req.checked and reference is not None and req.name in reference:
            self.checked += 1
            if outcome.text != reference[req.name]:
                self.mismatches.append(req.name)

    def report(self) -> dict:
        return {"sent": self.sent, "completed": self.verdicts.get("ok", 0),
                "failed": self.sent - self.verdicts.get("ok", 0) - self.verdicts.get("client", 0),
                "verdicts": dict(sorted(self.verdicts.items())), "errors": self.errors,
                "checked_against_reference": self.checked, "mismatches": len(self.mismatches),
                "mismatched_requests": self.mismatches[:20]}
