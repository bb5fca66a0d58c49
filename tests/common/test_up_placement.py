"""`kvrelay up` places its engines for the machine and says so: by default one prefill and one decode node where
each gets two cores, else one colocated engine (named colocated-0) with every core; explicit counts are followed,
with a warning where they leave an engine less than two cores; --prefill 0 makes every engine a colocated one."""

import argparse

import pytest

from kvrelay.cli import up
from kvrelay.cli.args import UsageError
from kvrelay.common.system import format_cores, parse_cores


def _args(*argv: str) -> up.UpConfig:
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    return up.config_from_args(parser.parse_args(["up", *argv]))


def _flag(children: list[up.Child], flag: str) -> dict[str, str]:
    """{child name: the value it gets for `flag`}, for the children given the flag."""
    return {c.name: c.argv[c.argv.index(flag) + 1] for c in children if flag in c.argv}


@pytest.mark.parametrize(("cores", "argv", "want"), [
    (2, [], {"colocated-0": "2"}),  # too small to disaggregate: one colocated engine
    (3, [], {"colocated-0": "3"}),
    (4, [], {"prefill-0": "2", "decode-0": "2"}),
    (2, ["--prefill", "1", "--decode", "1"], {"prefill-0": "1", "decode-0": "1"}),
    (2, ["--decode", "1"], {"prefill-0": "1", "decode-0": "1"}),  # one count given: disaggregated, as asked
    (2, ["--colocated"], {"colocated-0": "2"}),
    (4, ["--prefill", "0", "--decode", "2"], {"colocated-0": "2", "colocated-1": "2"}),
    (16, ["--prefill", "2", "--decode", "2"], {f"{r}-{i}": "4" for r in ("prefill", "decode") for i in (0, 1)}),
    (3, ["--prefill", "2", "--decode", "2"], {f"{r}-{i}": "1" for r in ("prefill", "decode") for i in (0, 1)}),
])
def test_engines_share_the_cores(monkeypatch, cores, argv, want):
    monkeypatch.setattr(up.os, "cpu_count", lambda: cores)
    args = _args(*argv)
    assert _flag(up.plan_children(args, "redis://127.0.0.1:1/0", up.placement(args)), "--num-threads") == want


def test_placement_note_says_what_was_chosen_and_why(monkeypatch):
    monkeypatch.setattr(up.os, "cpu_count", lambda: 2)
    auto = up.placement(_args())
    assert auto.colocated and auto.note.startswith("2 CPU cores: 2 torch thread(s) per engine; one colocated engine")
    assert "--prefill 1 --decode 1" in auto.note
    forced = up.placement(_args("--prefill", "1", "--decode", "1"))
    assert not forced.colocated and (forced.prefill, forced.decode) == (1, 1)
    assert forced.note.startswith("2 CPU cores: 1 torch thread(s) per engine; with a core or less")
    assert "--colocated" in forced.note
    local = "; KV connector local, as a lone engine hands KV to no other process"
    assert up.placement(_args("--colocated")).note == "2 CPU cores: 2 torch thread(s) per engine" + local
    assert auto.note.endswith(local)
    monkeypatch.setattr(up.os, "cpu_count", lambda: 8)
    assert up.placement(_args()).note == "8 CPU cores: 4 torch thread(s) per engine"
    assert up.placement(_args("--prefill", "3", "--decode", "1")).note == "8 CPU cores: 2 torch thread(s) per engine"


@pytest.mark.parametrize("argv", [
    [],
    ["--block-size", "32"],
    ["--prefill", "1", "--decode", "1", "--block-size", "64"],
])
def test_every_process_gets_the_fleet_block_size(argv):
    # The gateway refuses to route to a node whose block size differs from its own.
    args = _args(*argv)
    children = up.plan_children(args, "redis://127.0.0.1:1/0", up.placement(args))
    sizes = _flag(children, "--block-size")
    assert set(sizes) == {c.name for c in children}  # the gateway and every node
    assert "gateway" in sizes
    assert set(sizes.values()) == {str(args.block_size)}


@pytest.mark.parametrize(("cores", "argv", "want"), [
    (2, [], {"colocated-0": "local"}),  # colocated: no KV crosses a process, so no transfer threads either
    (2, ["--colocated"], {"colocated-0": "local"}),
    (2, ["--connector", "auto"], {"colocated-0": "auto"}),  # asked for: followed
    (4, [], {"prefill-0": "auto", "decode-0": "auto"}),
    (2, ["--prefill", "1", "--decode", "1", "--connector", "ucx"], {"prefill-0": "ucx", "decode-0": "ucx"}),
])
def test_nodes_get_the_connector_their_placement_needs(monkeypatch, cores, argv, want):
    monkeypatch.setattr(up.os, "cpu_count", lambda: cores)
    args = _args(*argv)
    assert _flag(up.plan_children(args, "redis://127.0.0.1:1/0", up.placement(args)), "--connector") == want


@pytest.mark.parametrize(("usable", "argv", "want", "reserved"), [
    ((0, 1), ["--reserved-cores", "1"], {"colocated-0": "1"}, (0,)),
    ((0, 1, 2, 3, 4, 5, 6, 7), ["--reserved-cores", "2"], {"prefill-0": "2-4", "decode-0": "5-7"}, (0, 1)),
    ((4, 5, 6, 7), ["--reserved-cores", "1", "--prefill", "2", "--decode", "2"],  # 3 cores for 4 engines
     {"prefill-0": "5", "prefill-1": "6", "decode-0": "7", "decode-1": "5"}, (4,)),
])
def test_reserved_cores_pin_each_engine_to_its_own(monkeypatch, usable, argv, want, reserved):
    monkeypatch.setattr(up.os, "cpu_count", lambda: len(usable))
    monkeypatch.setattr("kvrelay.cli.placement.usable_cores", lambda: usable)
    args = _args(*argv)
    where = up.placement(args)
    children = up.plan_children(args, "redis://127.0.0.1:1/0", where)
    assert _flag(children, "--cpu-cores") == want  # the gateway gets none: it inherits the launcher's
    threads = _flag(children, "--num-threads")
    assert all(threads[name] == str(len(parse_cores(cores))) for name, cores in want.items())
    assert where.reserved == reserved
    assert f"the gateway and Redis on {format_cores(reserved)} (--reserved-cores)" in where.note


def test_unpinned_by_default_and_no_core_left_is_refused(monkeypatch):
    args = _args()
    assert up.placement(args).reserved == () and not _flag(up.plan_children(args, "redis://127.0.0.1:1/0",
                                                                            up.placement(args)), "--cpu-cores")
    monkeypatch.setattr(up, "usable_cores", lambda: (0, 1))
    with pytest.raises(UsageError, match="--reserved-cores: 2 leaves no core for the engines"):
        up.preflight(_args("--reserved-cores", "2"))
