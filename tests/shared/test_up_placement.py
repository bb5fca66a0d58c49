"""`kvrelay up` shares the machine's cores among its engines and says so, warning where disaggregation leaves
each engine less than two cores."""

import argparse

import pytest

from shared.cli import up


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


def _threads(children: list[up.Child]) -> dict[str, str]:
    return {c.name: c.argv[c.argv.index("--num-threads") + 1] for c in children if "--num-threads" in c.argv}


@pytest.mark.parametrize(("cores", "argv", "want"), [
    (2, [], {"prefill-0": "1", "decode-0": "1"}),
    (2, ["--colocated"], {"decode-0": "2"}),
    (16, ["--prefill", "2", "--decode", "2"], {f"{r}-{i}": "4" for r in ("prefill", "decode") for i in (0, 1)}),
    (3, ["--prefill", "2", "--decode", "2"], {f"{r}-{i}": "1" for r in ("prefill", "decode") for i in (0, 1)}),
])
def test_engines_share_the_cores(monkeypatch, cores, argv, want):
    monkeypatch.setattr(up.os, "cpu_count", lambda: cores)
    assert _threads(up.plan_children(_args(*argv), "redis://127.0.0.1:1/0")) == want


def test_placement_note_warns_only_when_disaggregation_starves_the_engines(monkeypatch):
    monkeypatch.setattr(up.os, "cpu_count", lambda: 2)
    assert up.placement_note(_args()).startswith("2 CPU cores: 1 torch thread(s) per engine; with a core or less")
    assert "--colocated" in up.placement_note(_args())
    assert up.placement_note(_args("--colocated")) == "2 CPU cores: 2 torch thread(s) per engine"
    monkeypatch.setattr(up.os, "cpu_count", lambda: 8)
    assert up.placement_note(_args()) == "8 CPU cores: 4 torch thread(s) per engine"
