"""Byte sizes as people write them: the one parser every byte-sized flag (and KVRELAY_<FLAG> variable) uses.

    parse_bytes("512MiB") == 512 * 2**20      binary units: KiB MiB GiB TiB (or Ki Mi Gi Ti, as Kubernetes)
    parse_bytes("2GB") == parse_bytes("2G")   decimal units: kB/KB MB GB TB, or K M G T alone (SI, Kubernetes)
    parse_bytes("2e9") == 2_000_000_000       plain numbers are bytes (whole; an exponent is fine)
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_SIZE = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")
EXAMPLES = "e.g. 512MiB, 4GiB, 2GB, 2e9 or plain bytes"


def parse_bytes(text: str | int) -> int:
    """Bytes from an int or a size with an optional unit (case-insensitive); ValueError says what is wrong."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.fullmatch(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{text!r} is not a byte size ({EXAMPLES})")
        number = float(match.group(1)) * _UNITS[unit]
        if not unit and number != int(number):
            raise ValueError(f"{text!r} is not a whole number of bytes")
        value = round(number)  # 1.1GiB is 1181116006.4 bytes: a unit's fraction rounds
    if value < 0:
        raise ValueError(f"{text!r} is negative; a byte size is 0 or more ({EXAMPLES})")
    return value


def format_bytes(num: int | float) -> str:
    """The largest binary unit that keeps the number at 1 or more: 1536 -> '1.5 KiB', 2**30 -> '1.0 GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num) >= size:
            return f"{num / size:.1f} {unit}"
    return f"{int(num)} B"


def byte_size(text: str) -> int:
    """parse_bytes as an argparse `type`: a bad size is reported with the flag's name."""
    import argparse

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
