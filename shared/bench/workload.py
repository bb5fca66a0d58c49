"""What the benchmarks send: seeded prompts of real English text, identical on every machine.

The text is the documentation of a fixed list of Python standard-library modules (module, class and function
docstrings in a fixed order): available offline, and the same wherever the Python version is. From it:
- `build_workload`: the offline requests of `bench throughput` and its baselines, windows of the corpus token
  stream at seeded offsets cut to exact input lengths, each with an exact output length;
- `TextSource` and `iter_sessions`: the served benchmarks' conversations, lengths in tokens with a tokenizer and
  in words without. random: one turn; multi-tenant: the tenant's long shared system prompt and a fresh question;
  multi-turn: each turn carries the conversation so far, replies as the server returned them (`Conversation`);
- `copy_tasks`: requests whose answers repeat long spans of their prompt (refactor a stdlib function, fix a typo
  in or summarise a docstring), on which speculative decoding by prompt lookup is measured.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import random
import re
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

# Imported only for their docstrings; none of them has side effects on import.
CORPUS_MODULES: tuple[str, ...] = (
    "argparse", "collections", "textwrap", "difflib", "json", "re", "pathlib", "functools", "itertools",
    "logging", "dataclasses", "inspect", "datetime", "decimal", "fractions", "statistics", "random",
    "string", "heapq", "bisect", "shutil", "subprocess", "threading", "queue", "sched", "csv", "zipfile",
    "tarfile", "unittest", "doctest", "pickle", "copy", "pprint", "enum", "abc", "contextlib", "calendar",
    "configparser", "tempfile", "glob", "fnmatch", "email.message", "email.utils", "http.client",
    "urllib.parse", "urllib.request", "html.parser", "xml.dom.minidom", "socket", "selectors", "typing",
    "types", "weakref", "codecs", "base64", "hashlib", "hmac", "secrets", "uuid", "ipaddress", "numbers",
    "optparse", "gettext", "locale", "ftplib", "smtplib", "imaplib", "mailbox", "tokenize", "ast", "dis",
    "pdb", "cmd", "shlex", "trace", "timeit", "cProfile", "pstats", "gzip", "bz2", "lzma", "zipimport",
    "plistlib", "mimetypes", "netrc", "sqlite3", "asyncio.events", "asyncio.tasks", "asyncio.streams",
    "concurrent.futures", "multiprocessing.pool", "os", "io", "warnings", "operator",
)
DATASETS = ("random", "multi-tenant", "multi-turn")


def iter_corpus_docs(modules: Sequence[str] = CORPUS_MODULES) -> Iterator[str]:
    """Each module's docstring, then those of its own classes and functions (40 characters or more), by name."""
    seen: set[str] = set()
    for name in modules:
        module = importlib.import_module(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # e.g. touching typing.io
            objects = [obj for _, obj in sorted(vars(module).items()) if (inspect.isclass(obj) or inspect.isfunction(
                obj)) and getattr(obj, "__module__", None) == module.__name__]
            docs = [inspect.getdoc(module)] + [d for obj in objects if len(d := inspect.getdoc(obj) or "") >= 40]
        for doc in docs:
            if doc and doc not in seen:
                seen.add(doc)
                yield doc


def corpus_tokens(encode: Callable[[str], list[int]], min_tokens: int = 0,
                  modules: Sequence[str] = CORPUS_MODULES) -> list[int]:
    """The corpus as one token stream (each doc tokenized on its own), repeated up to `min_tokens`."""
    tokens = [t for doc in iter_corpus_docs(modules) for t in encode(doc + "\n\n")]
    if not tokens:
        raise ValueError("corpus: no docstrings found")
    return tokens * (min_tokens // len(tokens) + 1) if len(tokens) < min_tokens else tokens


# -- offline requests -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    """One offline request: its exact prompt and the exact number of tokens it must generate."""

    index: int  # arrival order
    prompt_token_ids: tuple[int, ...]
    output_len: int
    offset: int  # where the prompt starts in the corpus token stream

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """How many requests, their seed, and the (shortest, longest) prompt and output, in tokens."""

    num_requests: int = 128
    seed: int = 0
    input_len: tuple[int, int] = (16, 1024)
    output_len: tuple[int, int] = (8, 256)

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        _check_range("input", *self.input_len)
        _check_range("output", *self.output_len)


def _check_range(what: str, lo: int, hi: int) -> None:
    if not 1 <= lo <= hi:
        raise ValueError(f"{what} lengths: need 1 <= min <= max, got {lo}..{hi}")


def build_workload(encode: Callable[[str], list[int]], spec: WorkloadSpec | None = None,
                   vocab_size: int | None = None) -> list[BenchRequest]:
    """The requests in arrival order: the same tokenizer and spec give the same requests. `vocab_size` folds
    token ids into a smaller vocabulary (tiny test checkpoints)."""
    spec = spec or WorkloadSpec()
    stream = corpus_tokens(encode, 2 * spec.input_len[1])
    if vocab_size is not None:
        stream = [t % vocab_size for t in stream]
    rng, requests = random.Random(spec.seed), []
    for i in range(spec.num_requests):
        input_len, output_len = rng.randint(*spec.input_len), rng.randint(*spec.output_len)
        offset = rng.randint(0, len(stream) - input_len)
        requests.append(BenchRequest(i, tuple(stream[offset:offset + input_len]), output_len, offset))
    return requests


def fingerprint(requests: Sequence[BenchRequest]) -> str:
    """sha256 over every request's prompt token ids and output length, in order."""
    h = hashlib.sha256()
    for r in requests:
        h.update(f"{r.output_len}:{len(r.prompt_token_ids)}:{','.join(map(str, r.prompt_token_ids))};".encode())
    return h.hexdigest()


def summarize(requests: Sequence[BenchRequest], spec: WorkloadSpec) -> dict:
    inputs, outputs = sum(r.input_len for r in requests), sum(r.output_len for r in requests)
    return {"num_requests": len(requests), "seed": spec.seed, "input_len_range": list(spec.input_len),
            "output_len_range": list(spec.output_len), "input_tokens": inputs, "output_tokens": outputs,
            "mean_input_len": inputs / len(requests), "mean_output_len": outputs / len(requests),
            "fingerprint": fingerprint(requests),
            "text_source": "docstrings of Python stdlib modules (kvrelay.bench.workload.CORPUS_MODULES)"}


# -- served conversations ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _corpus_words() -> tuple[str, ...]:
    return tuple(word for doc in iter_corpus_docs() for word in doc.split())


class TextSource:
    """Corpus windows of about a given length: tokens with a tokenizer (encode/decode), else words."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.unit = "words" if tokenizer is None else "tokens"
        self._stream: list = list(_corpus_words()) if tokenizer is None else corpus_tokens(self._encode)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def window(self, rng: random.Random, length: int) -> str:
        """`length` units of corpus text from a seeded offset."""
        while len(self._stream) < 2 * length:
            self._stream = self._stream * 2
        start = rng.randint(0, len(self._stream) - length)
        piece = self._stream[start:start + length]
        return " ".join(piece) if self.tokenizer is None else self.tokenizer.decode(piece)

    def measure(self, text: str) -> int:
        """The length of `text` in the source's unit."""
        return len(text.split()) if self.tokenizer is None else len(self._encode(text))


@dataclass(frozen=True)
class DatasetSpec:
    name: str = "random"
    seed: int = 0
    min_input: int = 32  # user message length, in the source's unit
    max_input: int = 512
    min_output: int = 16  # max_tokens of a request
    max_output: int = 128
    tenants: int = 4  # multi-tenant: distinct shared system prompts
    system_len: int = 1024  # multi-tenant: system prompt length
    turns: int = 4  # multi-turn: turns per conversation

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset: one of {', '.join(DATASETS)}, got {self.name!r}")
        _check_range("input", self.min_input, self.max_input)
        _check_range("output", self.min_output, self.max_output)
        for name in ("tenants", "system_len", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """Turns sent one after the other, each after the previous reply."""

    index: int
    turns: tuple[Turn, ...]
    system: str | None = None
    tenant: int | None = None


def iter_sessions(spec: DatasetSpec, source: TextSource) -> Iterator[Session]:
    """The dataset's sessions, without end; the same spec and source give the same sessions."""
    rng = random.Random(spec.seed)
    systems = tenant_prompts(spec, source) if spec.name == "multi-tenant" else []

    def turn(header: str) -> Turn:
        input_len = rng.randint(spec.min_input, spec.max_input)
        max_tokens = rng.randint(spec.min_output, spec.max_output)
        return Turn(header + source.window(rng, input_len), max_tokens)

    for i in itertools.count():
        if spec.name == "random":
            yield Session(i, (turn(""),))
        elif spec.name == "multi-tenant":
            tenant = rng.randrange(spec.tenants)
            yield Session(i, (turn(f"Question {i}: explain this passage.\n\n"),), systems[tenant], tenant)
        else:
            yield Session(i, tuple(turn(f"Turn {t + 1}: continue with this passage.\n\n") for t in range(spec.turns)))


def tenant_prompts(spec: DatasetSpec, source: TextSource) -> list[str]:
    rng = random.Random(f"tenants-{spec.seed}")
    return [f"You are the assistant of tenant {k}. Answer using this reference documentation.\n\n"
            + source.window(rng, spec.system_len) for k in range(spec.tenants)]


def iter_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Poisson send times (seconds after the start) at `rate` per second: 0, then seeded exponential gaps."""
    rng, t = random.Random(seed), 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


async def send_poisson(rate: float, duration: float, rng: random.Random, send: Callable[[], Awaitable]) -> list:
    """Call `send()` at Poisson arrivals of `rate` per second (the first after one gap) for `duration` seconds,
    without waiting for the answers; all the answers, in order of sending."""
    tasks, t_end, next_at = [], time.perf_counter() + duration, time.perf_counter()
    while True:
        next_at += rng.expovariate(rate)
        if next_at >= t_end:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(send()))
    return list(await asyncio.gather(*tasks))


def alone_then_loaded(rounds: int, loaded: str, measure: Callable[[bool, int], dict]) -> list[dict]:
    """`rounds` pairs of phases, the first of each alone and the second under load (its phase named `loaded`):
    `measure(under_load, round)`'s result with its round and phase, each printed as a JSON line as it ends."""
    phases = []
    for r in range(rounds):
        for under_load in (False, True):
            phases.append({"round": r + 1, "phase": loaded if under_load else "alone", **measure(under_load, r)})
            print(json.dumps(phases[-1]), flush=True)
    return phases


def p90_ratio(phases: list[dict], metric: str, loaded: str) -> float | None:
    """The loaded phases' p90s of `metric` summed over the alone phases' (None without both)."""
    alone = [p[metric]["p90"] for p in phases if p["phase"] == "alone"]
    under = [p[metric]["p90"] for p in phases if p["phase"] == loaded]
    return round(sum(under) / sum(alone), 3) if alone and under else None


@dataclass
class Conversation:
    """The growing message list of one session: its user turns and the replies the server returned."""

    session: Session
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.session.system is not None and not self.messages:
            self.messages.append({"role": "system", "content": self.session.system})

    def ask(self, turn: Turn) -> list[dict]:
        """Append the turn's user message; a copy of the messages to send."""
        self.messages.append({"role": "user", "content": turn.user})
        return [dict(m) for m in self.messages]

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def completion_prompt(messages: list[dict]) -> str:
    """The messages as one plain-text prompt, for the completions endpoint."""
    parts = [m["content"] if m["role"] == "system" else f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


# -- copy-heavy tasks -----------------------------------------------------------------------------------

# Short, self-contained standard-library functions, stable across Python versions.
REFACTOR_FUNCTIONS = (
    "textwrap.indent", "textwrap.dedent", "shutil.copyfileobj", "os.path.commonprefix", "posixpath.splitext",
    "json.dump", "heapq.nsmallest", "bisect.insort_right", "fnmatch.filter", "calendar.monthrange",
    "base64.b32encode", "string.capwords", "glob.escape", "shlex.quote", "difflib.get_close_matches",
    "statistics.median", "statistics.mode", "random.Random.choices", "copy.deepcopy", "functools.cmp_to_key",
)
CODE_TASKS = (
    "Rename the parameter `{param}` to `{param}_value` in the following function and return the whole function:",
    "Rewrite the following Python function to use f-strings where possible. Return the whole function.",
    "Rename the function `{name}` to `{name}_v2` and return the whole function, unchanged otherwise:",
    "Add type hints to the following function and return the whole function:",
)
TEXT_TASKS = ("Fix the typo in the following text and return the corrected text:",
              "Summarize the following text in a few sentences, quoting its key sentences:")


def _function_source(dotted: str) -> str | None:
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            return inspect.getsource(functools.reduce(getattr, parts[cut:], obj))
        except (AttributeError, OSError, TypeError):
            return None
    return None


def copy_tasks(num: int) -> list[tuple[str, str]]:
    """(kind, user message) pairs: two code tasks for each text task, over distinct functions and documents."""
    docs = [d for d in iter_corpus_docs() if 400 <= len(d) <= 1200]
    sources = [(f, s) for f in REFACTOR_FUNCTIONS if (s := _function_source(f)) and 8 <= s.count("\n") <= 45]
    tasks = []
    for i in range(num):
        if i % 3 == 2:
            doc, task = docs[(i * 7) % len(docs)], TEXT_TASKS[(i // 3) % len(TEXT_TASKS)]
            tasks.append(("text", f"{task}\n\n{doc.replace('the ', 'teh ', 1) if 'typo' in task else doc}"))
            continue
        name, src = sources[i % len(sources)]
        param = re.search(r"def \w+\((?:self, )?(\w+)", src)
        task = CODE_TASKS[i % len(CODE_TASKS)].format(name=name.rsplit(".", 1)[-1], param=param[1] if param else "x")
        tasks.append(("code", f"{task}\n\n```python\n{src}```"))
    return tasks
