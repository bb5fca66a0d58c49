"""The gateway's shutdown against scripted nodes (kvrelay.gateway.server, GatewayCore.cut): new requests get 503
with Retry-After while open ones get the grace period; a stream still open after it ends with a final error
event in OpenAI's shape and [DONE], a plain request with a 503, and their sequences are aborted on the nodes;
an idle gateway stops at once; and nothing is logged with a traceback."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from tests.gateway.test_fake_nodes import Fleet

GRACE_S = 1.0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logged():
    """Every record of uvicorn's and the gateway's loggers (uvicorn's do not reach the root logger)."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "kvrelay")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler.records
    for lg in loggers:
        lg.removeHandler(handler)


@pytest.fixture
def fleet(default_tokenizer):
    f = Fleet(default_tokenizer, n_prefill=0, n_decode=1, shutdown_timeout=GRACE_S)
    f.script.token_delay_s = 0.02
    yield f
    if f._gw_thread.is_alive():
        f.close()


def _body(stream: bool, max_tokens: int) -> dict:
    return {"prompt": "Tell me a long story. " * 4, "max_tokens": max_tokens, "stream": stream}


def _stop_in_background(f: Fleet) -> threading.Thread:
    """SIGTERM, as uvicorn sees it; returns the thread that waits for the gateway to stop."""
    t = threading.Thread(target=f.close)
    t.start()
    return t


def _events(lines: list[str]) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data:")]


def test_a_stream_past_the_grace_ends_with_an_error_event_then_done(fleet, logged):
    with httpx.Client(timeout=30) as http, http.stream("POST", fleet.url + "/v1/completions",
                                                      json=_body(True, 400)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        t0 = time.monotonic()
        stopping = _stop_in_background(fleet)
        rest = list(lines)
        elapsed = time.monotonic() - t0
    events = _events([first, *rest])
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's error shape
    text_events = events[:-2]
    assert len(text_events) > 10 and all("choices" in e for e in text_events)  # it streamed through the grace
    assert GRACE_S <= elapsed < GRACE_S + 2.0
    stopping.join(10)
    assert not stopping.is_alive() and not fleet._gw_thread.is_alive()
    assert fleet.script.aborted, "the node's sequence was not aborted"
    assert not [r for r in logged if r.exc_info or "Traceback" in r.getMessage()], [r.getMessage() for r in logged]


def test_new_requests_get_503_while_open_ones_drain(fleet):
    with httpx.Client(timeout=30) as http, http.stream("POST", fleet.url + "/v1/completions",
                                                      json=_body(True, 30)) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        stopping = _stop_in_background(fleet)
        deadline = time.monotonic() + GRACE_S
        while not fleet.gateway.core.draining and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(fleet.url + "/v1/completions", json=_body(False, 2), timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "shutting_down"
        events = _events(list(lines))
    # 30 tokens at 20 ms fit in the grace: the stream completes normally.
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    stopping.join(10)
    assert not fleet._gw_thread.is_alive()


def test_a_plain_request_past_the_grace_gets_503(fleet):
    result: dict = {}

    def call() -> None:
        result["reply"] = httpx.post(fleet.url + "/v1/completions", json=_body(False, 400), timeout=30)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 10
    while not fleet.gateway.core.active and time.monotonic() < deadline:
        time.sleep(0.01)
    stopping = _stop_in_background(fleet)
    caller.join(GRACE_S + 5)
    reply = result["reply"]
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down"
    assert reply.headers["retry-after"] == "1"
    stopping.join(10)


def test_an_idle_gateway_stops_at_once(fleet):
    t0 = time.monotonic()
    fleet.close()
    assert time.monotonic() - t0 < 1.0
