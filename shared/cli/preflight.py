"""Checks run before anything starts: `kvrelay up` runs all of them before its first child, `kvrelay prefill|decode`
the engine's and its ports', `kvrelay gateway` its ports'. Each failure is a UsageError naming the flag (one line,
exit code 2), in about a second: nothing here imports torch or loads weights (the model's shape comes from its
config, kvrelay.engine.model_info).

What is checked: ports free (HTTP, gRPC, metrics), counts and sizes in range, the fleet's shape, the device, the
--max-model-len against the model's context, and a KV cache large enough for one sequence
(kvrelay.engine.model_info.MIN_USEFUL_TOKENS says what one sequence is without --max-model-len).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

from kvrelay.cli.args import UsageError, flag_name
from kvrelay.common.system import free_port
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.model_info import ConfigError, ModelShape, check_engine_config


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on now (the OS's words), or None when it can. Binds as the servers do
    (SO_REUSEADDR), so a port in TIME_WAIT counts as free and one with a listener as taken."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e.strerror})"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_port(host: str, port: int, flag: str, hint: str = "") -> None:
    """UsageError naming `flag` when `port` is out of range or `host:port` is taken (port 0: any, never taken)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"{port} is not a port (0-65535)", flag)
    if port == 0:
        return
    reason = port_taken(host, port)
    if reason is None:
        return
    if reason.startswith("cannot resolve") or "assign" in reason:  # the interface, not the port
        raise UsageError(f"{host} is no interface of this machine ({reason})", "--host")
    raise UsageError(f"{port} is taken on {host} ({reason}){hint}", flag)


def derived_port(host: str, base: int, offset: int, taken: Iterable[int] = ()) -> int:
    """`base + offset` when free (so a second fleet on another --port gets its own), else any free port."""
    port = base + offset
    if 0 < port <= 65535 and port not in set(taken) and port_taken(host, port) is None:
        return port
    return free_port(host)


def check_engine(config: EngineConfig, shape: ModelShape | None = None) -> ModelShape:
    """The engine's own checks (kvrelay.engine.model_info.check_engine_config) as a UsageError on the flag."""
    try:
        return check_engine_config(config, shape)
    except ConfigError as e:
        raise UsageError(e.message, flag_name(e.field)) from None


def check_at_least(values: Iterable[tuple[str, float | int | None, float | int]]) -> None:
    """(flag, value, least) for each: UsageError when a value that is set is below its least."""
    for flag, value, least in values:
        if value is not None and value < least:
            raise UsageError(f"{value:g} is below {least:g}" if isinstance(value, float) else
                             f"{value} is below {least}", flag)


def check_fleet_shape(prefill: int | None, decode: int | None, colocated: bool) -> None:
    """A fleet must have an engine that decodes; a prefill node needs a decode node to hand its KV to."""
    check_at_least([("--prefill", prefill, 0), ("--decode", decode, 0)])
    if colocated and prefill:
        raise UsageError(f"{prefill} contradicts --colocated (a colocated engine computes its own prompts); drop "
                         "one of the two", "--prefill")
    if decode == 0:
        if prefill:
            raise UsageError(f"0 with --prefill {prefill} leaves the prefill nodes nobody to hand their KV to (a "
                             "decode node streams the tokens); give --decode 1 or more", "--decode")
        raise UsageError("0 with --prefill 0 leaves nothing to serve; give --decode 1 or more (with --prefill 0 "
                         "each decode node computes its prompts too)", "--decode")
