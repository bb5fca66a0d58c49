"""The gateway's image handling (gateway.images) on its own: data URLs, http(s) URLs from a real HTTP server on
loopback (only when allowed, within the byte limit and the timeout), each refusal a 400 naming the part, and the
placeholder widening that gives every image its positions and content hash."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time

import pytest

from kvrelay.common.hashing import image_hash
from kvrelay.gateway.errors import BadRequest
from kvrelay.gateway.images import ChatImages
from kvrelay.gateway.input_limits import InputLimits
from kvrelay.gateway.protocol import ChatMessage
from kvrelay.model_files.vision import VisionSpec
from tests.helpers.models import png

SPEC = VisionSpec(image_token_id=7, image_token="<image>", tokens_per_image=3, shortest_edge=28, crop=(28, 28),
                  resample=3, rescale_factor=1 / 255, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
IMAGE = png(1, 20, 10)


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path == "/slow.png":
            time.sleep(1.5)
        body = {"/big.png": b"x" * 5000}.get(self.path, IMAGE)
        if self.path == "/missing.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that stops reading past its byte limit breaks the pipe: expected here


@pytest.fixture(scope="module")
def server():
    httpd = _Server(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _messages(*urls: str) -> list[ChatMessage]:
    parts = [{"type": "text", "text": "look"}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    return [ChatMessage(role="user", content=parts)]


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _load(images: ChatImages, *urls: str) -> list[bytes]:
    return asyncio.run(images.load(_messages(*urls)))


def _refused(images: ChatImages, *urls: str) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        _load(images, *urls)
    return err.value


def test_data_urls_and_fetched_urls(server):
    images = ChatImages(SPEC, InputLimits(allow_image_urls=True, max_image_bytes=4000, image_fetch_timeout=1.0), "m")
    assert _load(images, _url(IMAGE), f"{server}/cat.png") == [IMAGE, IMAGE]
    assert "exceeds 4000 bytes" in str(_refused(images, f"{server}/big.png"))
    assert "HTTP 404" in str(_refused(images, f"{server}/missing.png"))
    assert "longer than 1 s" in str(_refused(images, f"{server}/slow.png"))


def test_each_refusal_names_the_part(server):
    images = ChatImages(SPEC, InputLimits(max_images_per_request=2, max_image_pixels=150), "m")
    assert _refused(images, _url(IMAGE), "file:///etc/passwd").param == "messages[0].content[2].image_url"
    assert "not fetched by this server" in str(_refused(images, f"{server}/cat.png"))
    assert "not valid base64" in str(_refused(images, "data:image/png;base64,%%%"))
    assert "must be base64" in str(_refused(images, "data:image/png,rawbytes"))
    assert "could not decode" in str(_refused(images, _url(b"GIF89a nothing")))
    assert "20x10 pixels exceeds the limit of 150" in str(_refused(images, _url(IMAGE)))
    assert "3 images, more than the limit of 2" in str(_refused(images, *[_url(IMAGE)] * 3))
    text_only = ChatImages(None, InputLimits(), "smol")
    assert "takes no images" in str(_refused(text_only, _url(IMAGE)))
    assert _load(text_only) == []


def test_placeholders_widen_to_each_images_positions():
    images = ChatImages(SPEC, InputLimits(), "m")
    a, b = png(2, 8, 8), png(3, 8, 8)
    tokens, found = images.expand([1, 7, 2, 7, 3], [a, b])
    assert tokens == [1, 7, 7, 7, 2, 7, 7, 7, 3]
    assert [(im.offset, im.length, im.content_hash) for im in found] == [(1, 3, image_hash(a)), (5, 3, image_hash(b))]
    with pytest.raises(BadRequest, match="2 image placeholders .* for 1 images"):
        images.expand([7, 7], [a])
