"""A gateway serving in this process on its own event-loop thread (port 0), for tests that drive it over HTTP."""

from __future__ import annotations

import asyncio
import threading

import openai

from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.server import make_server
from tests.helpers.nodes import wait_for

API_KEY = "test-key"


class GatewayThread:
    """A gateway serving on its own event loop thread (port 0), stopped like SIGTERM would."""

    def __init__(self, **kwargs) -> None:
        defaults = dict(port=0, shutdown_timeout=2, refresh_interval=0.2, health_interval=0.5)
        cfg = GatewayConfig(**{**defaults, **kwargs})
        self.server = make_server(cfg, log_level="warning")
        self.gateway = self.server.gateway
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 60, "gateway start", interval=0.02)
        self.address = f"127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        self.url = f"http://{self.address}"

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
