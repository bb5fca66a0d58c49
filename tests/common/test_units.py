"""One byte-size parser for every byte flag: units as people write them (binary KiB..TiB, decimal kB..TB, plain
bytes, exponents), refused with a message that says what a size looks like."""

import argparse

import pytest

from kvrelay.common.units import byte_size, format_bytes, parse_bytes


@pytest.mark.parametrize(("text", "want"), [
    ("512MiB", 512 * 2**20), ("1GiB", 2**30), ("1gib", 2**30), ("4 GiB", 4 * 2**30), ("2Gi", 2 * 2**30),
    ("1.5GiB", 3 * 2**29), ("1.1GiB", round(1.1 * 2**30)), ("2GB", 2 * 10**9), ("2G", 2 * 10**9), ("3kB", 3000),
    ("2e9", 2 * 10**9), ("1073741824", 2**30), ("0", 0), ("7B", 7), (12, 12),
])
def test_sizes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize(("text", "why"), [
    ("-1", "negative"), ("-1GiB", "negative"), (-5, "negative"), ("1.5", "whole"), ("1e-3", "whole"),
    ("abc", "not a byte size"), ("2x", "not a byte size"), ("", "not a byte size"), ("GiB", "not a byte size"),
])
def test_refused_sizes_say_why(text, why):
    with pytest.raises(ValueError, match=why):
        parse_bytes(text)


def test_the_argparse_type_names_the_flag():
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--kv-cache-memory", type=byte_size)
    assert p.parse_args(["--kv-cache-memory", "64MiB"]).kv_cache_memory == 64 * 2**20
    with pytest.raises(argparse.ArgumentError, match="--kv-cache-memory: '-1' is negative"):
        p.parse_args(["--kv-cache-memory", "-1"])


def test_format_bytes():
    assert [format_bytes(n) for n in (100, 1536, 5898240, 2**30, 3 * 2**40)] == \
        ["100 B", "1.5 KiB", "5.6 MiB", "1.0 GiB", "3.0 TiB"]
