"""Two base models and their LoRA adapters behind one `kvrelay up`, through the unmodified openai SDK.

The fleet (a fleet file): "alpha", a tiny Llama on two colocated engines with adapters a4 and a16 (ranks 4, 16);
"beta", a tiny Qwen2 on one prefill and one decode node (KV handed over) with adapter b8 (rank 8, attention only).
Every node runs with --enable-lora --max-loras 2. Checked:
- /v1/models lists both models under their names and the adapters with vLLM's root and parent, as the SDK reads it;
- greedy tokens equal HF transformers + PEFT for every adapter and both base models, requests of all of them at once
  (colocated and disaggregated), and after the node streaming an adapter's request is killed as the stream begins (it
  moves);
- a prefix cached under one adapter is a hit for that adapter only;
- an adapter loaded and unloaded through the gateway while other requests run: none fails; the unload waits for
  the adapter's running request; unknown models and adapters are 404 (model_not_found), malformed adapters a clear
  400, and the nodes go on serving;
- the nodes' vllm:lora_requests_info and adapter load counts reach the gateway's /metrics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.common.process import ChildProcess, kvrelay_command
from kvrelay.common.prometheus import Metrics
from kvrelay.common.system import free_port
from kvrelay.common.tokenizer import Tokenizer
from tests.helpers.lora import PeftReference, make_peft_adapter, tiny_with_tokenizer
from tests.helpers.procs import descendants

pytestmark = pytest.mark.timeout(900)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
IGNORE_EOS = {"ignore_eos": True}


class LoraFleet:
    def __init__(self, root: Path, tokenizer_dir: Path) -> None:
        self.alpha = tiny_with_tokenizer("llama", root / "alpha", tokenizer_dir, seed=1)
        self.beta = tiny_with_tokenizer("qwen2", root / "beta", tokenizer_dir, seed=2)
        self.adapters = {"a4": make_peft_adapter(self.alpha, root / "a4", 4, seed=11),
                         "a16": make_peft_adapter(self.alpha, root / "a16", 16, seed=12),
                         "b8": make_peft_adapter(self.beta, root / "b8", 8, ATTENTION, seed=13),
                         "b-new": make_peft_adapter(self.beta, root / "b-new", 4, ("v_proj", "down_proj"), seed=14)}
        self.refs = {"alpha": PeftReference(self.alpha, {n: self.adapters[n] for n in ("a4", "a16")}),
                     "beta": PeftReference(self.beta, {n: self.adapters[n] for n in ("b8", "b-new")})}
        self.tokenizer = Tokenizer(self.alpha)
        fleet_file = root / "fleet.yaml"
        fleet_file.write_text(json.dumps({"models": [  # JSON is YAML
            {"model": str(self.alpha), "served_model_name": ["alpha", "alpha-chat"], "colocated": True, "decode": 2,
             "lora_modules": [f"a4={self.adapters['a4']}", f"a16={self.adapters['a16']}"]},
            {"model": str(self.beta), "served_model_name": "beta", "prefill": 1, "decode": 1,
             "lora_modules": [f"b8={self.adapters['b8']}"]}]}))
        cmd = kvrelay_command("up", "--fleet-file", str(fleet_file), "--port", str(free_port()), "--dtype", "float32",
                              "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--kv-cache-memory",
                              "64MiB", "--log-dir", str(root / "logs"), "--shutdown-grace", "2")
        self.up = ChildProcess.start("up", cmd, log_dir=root)
        try:
            self.url = self.up.wait_ready(self._banner_url, timeout_s=400, interval_s=0.5)
        except BaseException:
            self.up.stop(10)
            raise
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120)

    def _banner_url(self) -> str | None:
        found = re.search(r"^  OpenAI base URL +: (\S+)", self.up.log_path.read_text(errors="replace"), re.MULTILINE)
        return found.group(1) if found else None

    def complete(self, model: str, prompt: list[int], n: int, **kw) -> str:
        reply = self.client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                               extra_body=IGNORE_EOS, **kw)
        return reply.choices[0].text

    def expected(self, base: str, prompt: list[int], n: int, adapter: str | None) -> str:
        return self.tokenizer.decode(self.refs[base].greedy(prompt, n, adapter))

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)

    def metrics(self) -> Metrics:
        return Metrics.scrape(self.url.removesuffix("/v1") + "/metrics")


@pytest.fixture(scope="module")
def fleet(default_model_dir, tmp_path_factory):
    f = LoraFleet(tmp_path_factory.mktemp("lora-fleet"), Path(default_model_dir))
    yield f
    f.up.stop(30)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 131) % 40000 + 100 for i in range(n)]


def test_models_and_adapters_list_as_the_sdk_reads_them(fleet):
    cards = {m.id: m for m in fleet.client.models.list().data}
    assert set(cards) == {"alpha", "alpha-chat", "beta", "a4", "a16", "b8"}
    assert cards["a4"].parent == "alpha" and cards["b8"].parent == "beta" and cards["beta"].parent is None
    assert cards["a16"].root == str(fleet.adapters["a16"]) and cards["alpha-chat"].root == "alpha"
    reply = fleet.client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4)
    assert reply.model == "beta" and reply.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError) as err:
        fleet.client.completions.create(model="gamma", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_greedy_tokens_equal_hf_peft_for_every_adapter_at_once(fleet):
    runs = [("alpha", m, p) for m in ("alpha", "a4", "a16") for p in (prompt(1, 20), prompt(2, 90))]
    runs += [("beta", m, p) for m in ("beta", "b8") for p in (prompt(3, 20), prompt(4, 90))]  # 90: disaggregated
    with ThreadPoolExecutor(len(runs)) as pool:
        texts = list(pool.map(lambda r: fleet.complete(r[1], r[2], 12), runs))
    for (base, model, p), text in zip(runs, texts, strict=True):
        assert text == fleet.expected(base, p, 12, None if model == base else model), (model, len(p))
    assert len({t for (b, _, p), t in zip(runs, texts) if b == "alpha" and len(p) == 90}) == 3  # adapters matter


def test_a_prefix_is_cached_per_adapter(fleet):
    long = prompt(5, 80)

    def cached(model: str) -> int:
        reply = fleet.client.completions.create(model=model, prompt=long, max_tokens=1, temperature=0)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("b8") == 0
    assert cached("beta") == 0 and cached("b8") == 64  # beta: one prefill node, whose cache answers
    assert cached("a4") == 0 and cached("a16") == 0 and cached("alpha") == 0


def test_load_and_unload_through_the_gateway_under_load(fleet):
    failures, done, stop = [], [0], threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            model = ("alpha", "a4", "beta", "b8")[i % 4]
            try:
                fleet.complete(model, prompt(100 + i, 24), 6)
                done[0] += 1
            except Exception as e:  # noqa: BLE001 - counted: the check is that there are none
                failures.append(f"{model}: {e!r}")
            i += 1

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        bad = fleet.post("/load_lora_adapter", {"lora_name": "big", "lora_path": str(_rank32(fleet)),
                                               "base_model_name": "beta"})
        assert bad.status_code == 400 and "--max-lora-rank 16" in bad.json()["error"]["message"]
        missing = fleet.post("/load_lora_adapter", {"lora_name": "gone", "lora_path": "/nonexistent/adapter",
                                                   "base_model_name": "beta"})
        assert missing.status_code == 400 and "/nonexistent/adapter" in missing.json()["error"]["message"]
        r = fleet.post("/load_lora_adapter", {"lora_name": "b-new", "lora_path": str(fleet.adapters["b-new"]),
                                             "base_model_name": "beta"})
        assert r.status_code == 200, r.text
        assert "b-new" in {m.id for m in fleet.client.models.list().data}
        p = prompt(6, 40)
        assert fleet.complete("b-new", p, 10) == fleet.expected("beta", p, 10, "b-new")
        # Unload while a long request for the adapter streams: the unload waits for it, the request completes.
        stream = fleet.client.completions.create(model="b-new", prompt=p, max_tokens=150, temperature=0,
                                                 stream=True, extra_body=IGNORE_EOS)
        chunks = iter(stream)
        first = next(chunks).choices[0].text
        with ThreadPoolExecutor(1) as pool:
            unloading = pool.submit(fleet.post, "/unload_lora_adapter", {"lora_name": "b-new"})
            text = first + "".join(c.choices[0].text for c in chunks if c.choices)
            assert unloading.result().status_code == 200
        assert text == fleet.expected("beta", p, 150, "b-new")
        with pytest.raises(openai.NotFoundError):
            fleet.complete("b-new", p, 2)
        assert fleet.post("/unload_lora_adapter", {"lora_name": "b-new"}).status_code == 404
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert failures == [] and done[0] > 0


def test_lora_metrics_reach_the_gateway(fleet):
    metrics = fleet.metrics()
    infos = metrics.select("vllm:lora_requests_info")
    assert infos and {s.labels["max_lora"] for s in infos} == {"2"}
    assert sum(s.value for s in metrics.select("kvrelay:lora_adapter_loads_total")) >= 5  # at start, and b-new


def test_a_request_keeps_its_adapter_when_its_node_dies_mid_stream(fleet):
    # 900 tokens: on a fast CPU the tiny model had sent all of 200 before the kill, and nothing moved.
    p, n = prompt(7, 40), 900
    pids = _node_pids(fleet.up.pid)  # looked up first: the kill must come before the tiny model's tokens are out
    # The node the stream runs on (its response headers say which) dies as soon as the stream has begun.
    raw = fleet.client.completions.with_raw_response.create(model="a16", prompt=p, max_tokens=n, temperature=0,
                                                            stream=True, extra_body=IGNORE_EOS)
    os.kill(pids[raw.headers["x-kvrelay-decode-node"]], signal.SIGKILL)
    text = "".join(c.choices[0].text for c in raw.parse() if c.choices)
    assert text == fleet.expected("alpha", p, n, "a16")
    assert sum(s.value for s in fleet.metrics().select("kvrelay:migrations_total")) >= 1


def _rank32(fleet: LoraFleet) -> Path:
    folder = fleet.adapters["b8"].parent / "r32"
    return folder if folder.exists() else make_peft_adapter(fleet.beta, folder, 32, ("q_proj",))


def _node_pids(up_pid: int) -> dict[str, int]:
    """The process of each node `kvrelay up` runs, by its node id."""
    pids = {}
    for pid in descendants(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--node-id" in argv:
            pids[argv[argv.index(b"--node-id") + 1].decode()] = pid
    return pids
