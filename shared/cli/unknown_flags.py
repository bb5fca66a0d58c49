"""What to say about a flag a command does not know: it is vLLM's and kvrelay does not support it, it belongs to
another kvrelay command, or it is a typo of one this command has."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Mapping

_SCALE_OUT = ("kvrelay runs each engine in one process on one device; scale out with more nodes instead "
              "(`kvrelay up --prefill N --decode M`)")
_LOCAL_MODEL = "models load from a local folder or .gguf file (--model); nothing is downloaded"

# vLLM's `serve` flags kvrelay has no equivalent of, and why. (`kvrelay up` takes --tensor-parallel-size and
# --pipeline-parallel-size, but only 1.)
VLLM_UNSUPPORTED: dict[str, str] = {
    "--tensor-parallel-size": _SCALE_OUT, "-tp": _SCALE_OUT,
    "--pipeline-parallel-size": _SCALE_OUT, "-pp": _SCALE_OUT,
    "--data-parallel-size": _SCALE_OUT, "-dp": _SCALE_OUT,
    "--distributed-executor-backend": _SCALE_OUT,
    "--kv-cache-dtype": "the KV cache is kept in the model's --dtype",
    "--enforce-eager": "kvrelay captures no CUDA graphs, so there is nothing to turn off: drop the flag",
    "--swap-space": "a preempted request is recomputed, never swapped",
    "--cpu-offload-gb": "weights stay on --device; there is no offloading",
    "--trust-remote-code": "only the built-in (Llama-style) architectures run; no remote code is loaded",
    "--tokenizer": "the tokenizer is the model's own; " + _LOCAL_MODEL,
    "--revision": _LOCAL_MODEL, "--download-dir": _LOCAL_MODEL, "--load-format": _LOCAL_MODEL,
    "--hf-token": _LOCAL_MODEL,
    "--chat-template": "the model's own chat template is used",
    "--enable-chunked-prefill": "chunked prefill is always on (--max-num-batched-tokens is the step's budget)",
    "--no-enable-chunked-prefill": "chunked prefill is always on (--max-num-batched-tokens is the step's budget)",
    "--max-logprobs": "logprobs are limited by the request only",
    "--disable-log-requests": "requests are logged only with `kvrelay gateway --log-requests`",
    "--uvicorn-log-level": "use `kvrelay --log-level LEVEL <command>` (or --log-level after the command)",
    "--guided-decoding-backend": "the grammar engine is the nodes' --structured-outputs-backend (xgrammar)",
    "--limit-mm-per-prompt": "kvrelay serves text models only",
}


def explain(command: str, extras: list[str], own: argparse.ArgumentParser,
            others: Callable[[], Mapping[str, argparse.ArgumentParser]]) -> str:
    """One line on the first argument of `extras` (what `kvrelay <command>` did not recognise). `others` builds
    the other commands' parsers; it is only called when the flag is not a vLLM flag kvrelay lacks."""
    flags = [arg.split("=", 1)[0] for arg in extras if arg.startswith("-")]
    rest = f" (also unrecognized: {' '.join(extras[1:])})" if len(extras) > 1 else ""
    if not flags:
        return f"unexpected argument {extras[0]!r}: `kvrelay {command}` takes flags only{rest}"
    flag = flags[0]
    if flag in VLLM_UNSUPPORTED:
        return f"{flag} is vLLM's, and kvrelay does not support it: {VLLM_UNSUPPORTED[flag]}"
    where = [name for name, parser in others().items() if name != command and flag in parser._option_string_actions]
    if where:
        commands = " and ".join(f"`kvrelay {name}`" for name in where)
        return f"{flag} is a flag of {commands}, not of `kvrelay {command}` (its flags: `kvrelay {command} --help`)"
    ours = [f for f in own._option_string_actions if f.startswith("--")]
    close = difflib.get_close_matches(flag, ours, n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]}?" if close else f"; see `kvrelay {command} --help`"
    return f"unrecognized argument {flag}{hint}{rest if len(flags) > 1 else ''}"
