"""Servers admit the shortest prompt first (with aging) unless told otherwise; offline runs keep the caller's
order, as vLLM does; `kvrelay up` passes an explicit policy to every engine it starts."""

import pytest

from kvrelay.cli import build_parser, up
from kvrelay.engine.args import engine_config
from kvrelay.engine.config import SchedulingPolicy


@pytest.mark.parametrize(("argv", "want"), [
    (["decode"], SchedulingPolicy.SJF),
    (["prefill"], SchedulingPolicy.SJF),
    (["decode", "--scheduling-policy", "fcfs"], SchedulingPolicy.FCFS),
    (["generate", "--prompt", "hello"], SchedulingPolicy.FCFS),
    (["bench", "throughput"], SchedulingPolicy.FCFS),
])
def test_default_waiting_order(argv, want):
    args = build_parser().parse_args(argv)
    assert engine_config(args).scheduler.policy == want


def test_up_forwards_an_explicit_policy_to_every_engine():
    def policies(*argv: str) -> list[str | None]:
        config = up.config_from_args(build_parser().parse_args(["up", "--prefill", "1", "--decode", "1", *argv]))
        children = up.plan_children(config, "redis://127.0.0.1:1/0", up.placement(config))
        engines = [c for c in children if c.name != "gateway"]
        assert len(engines) == 2
        return [c.argv[c.argv.index("--scheduling-policy") + 1] if "--scheduling-policy" in c.argv else None
                for c in engines]

    assert policies() == [None, None]  # the nodes' own default (sjf)
    assert policies("--scheduling-policy", "fcfs") == ["fcfs", "fcfs"]
