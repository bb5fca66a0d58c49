"""A deterministic mixed workload of real English text for the throughput benchmark.

The text is the documentation of a fixed list of Python standard-library modules (module, class and
function docstrings, in a fixed order), so it is available offline and identical on every machine with
the same Python version. It is tokenized with the model's tokenizer into one long token stream; each
request takes a window of the stream at a seeded offset, cut to exactly its input length.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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

DOC_SEPARATOR = "\n\n"
DEFAULT_NUM_REQUESTS = 128
DEFAULT_SEED = 0
DEFAULT_INPUT_RANGE = (16, 1024)
DEFAULT_OUTPUT_RANGE = (8, 256)


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: its exact prompt and the exact number of tokens it must generate."""

    index: int  # arrival order
    prompt_token_ids: tuple[int, ...]
    output_len: int
    offset: int  # where the prompt starts in the corpus token stream

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = DEFAULT_NUM_REQUESTS
    seed: int = DEFAULT_SEED
    min_input: int = DEFAULT_INPUT_RANGE[0]
    max_input: int = DEFAULT_INPUT_RANGE[1]
    min_output: int = DEFAULT_OUTPUT_RANGE[0]
    max_output: int = DEFAULT_OUTPUT_RANGE[1]

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        if not 1 <= self.min_input <= self.max_input:
            raise ValueError(f"input lengths: need 1 <= min_input <= max_input, got {self.min_input}..{self.max_input}")
        if not 1 <= self.min_output <= self.max_output:
            raise ValueError(
                f"output lengths: need 1 <= min_output <= max_output, got {self.min_output}..{self.max_output}"
            )


# -- corpus -------------------------------------------------------------------------------------------


def iter_corpus_docs(modules: Sequence[str] = CORPUS_MODULES) -> Iterator[str]:
    """Module docstrings, then those of the module's own classes and functions, sorted by name."""
    seen: set[str] = set()
    for name in modules:
        module = importlib.import_module(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # e.g. touching typing.io
            docs = list(_module_docs(module))
        for doc in docs:
            if doc not in seen:
                seen.add(doc)
                yield doc


def _module_docs(module) -> Iterator[str]:
    doc = inspect.getdoc(module)
    if doc:
        yield doc
    for _, obj in sorted(vars(module).items()):
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= 40:
            yield doc


def corpus_tokens(encode: Callable[[str], list[int]], min_tokens: int = 0,
                  modules: Sequence[str] = CORPUS_MODULES) -> list[int]:
    """The whole corpus as one token stream (each doc tokenized on its own), repeated up to `min_tokens`."""
    tokens: list[int] = []
    for doc in iter_corpus_docs(modules):
        tokens.extend(encode(doc + DOC_SEPARATOR))
    if not tokens:
        raise ValueError("corpus: no docstrings found")
    if len(tokens) < min_tokens:
        tokens = tokens * (min_tokens // len(tokens) + 1)
    return tokens


# -- workload -----------------------------------------------------------------------------------------


def build_workload(encode: Callable[[str], list[int]], spec: WorkloadSpec | None = None,
                   vocab_size: int | None = None) -> list[BenchRequest]:
    """The requests in arrival order. Same tokenizer and spec -> identical requests.

    `vocab_size` (optional) folds token ids into a smaller vocabulary (tiny test checkpoints).
    """
    spec = spec or WorkloadSpec()
    stream = corpus_tokens(encode, 2 * spec.max_input)
    if vocab_size is not None:
        stream = [t % vocab_size for t in stream]
    rng = random.Random(spec.seed)
    requests = []
    for i in range(spec.num_requests):
        input_len = rng.randint(spec.min_input, spec.max_input)
        output_len = rng.randint(spec.min_output, spec.max_output)
        offset = rng.randint(0, len(stream) - input_len)
        prompt = tuple(stream[offset:offset + input_len])
        requests.append(BenchRequest(i, prompt, output_len, offset))
    return requests


def fingerprint(requests: Sequence[BenchRequest]) -> str:
    """sha256 over every request's prompt token ids and output length, in order."""
    h = hashlib.sha256()
    for r in requests:
        h.update(f"{r.output_len}:{len(r.prompt_token_ids)}:".encode())
        h.update(",".join(map(str, r.prompt_token_ids)).encode())
        h.update(b";")
    return h.hexdigest()


def summarize(requests: Sequence[BenchRequest], spec: WorkloadSpec) -> dict:
    inputs = [r.input_len for r in requests]
    outputs = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "seed": spec.seed,
        "input_len_range": [spec.min_input, spec.max_input],
        "output_len_range": [spec.min_output, spec.max_output],
        "input_tokens": sum(inputs),
        "output_tokens": sum(outputs),
        "mean_input_len": sum(inputs) / len(inputs),
        "mean_output_len": sum(outputs) / len(outputs),
        "fingerprint": fingerprint(requests),
        "text_source": "docstrings of Python stdlib modules (kvrelay.bench.workload.CORPUS_MODULES)",
    }
