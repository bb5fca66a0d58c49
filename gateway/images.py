"""Images in chat messages (OpenAI's `image_url` content parts) for a vision-language model.

The gateway takes each image's bytes (a data: URL; an http(s) URL only with --allow-image-urls, fetched within
--max-image-bytes and --image-fetch-timeout), decodes it once to refuse what is not an image or is too large (a 400
naming the part, before any node is involved), and hashes it. The chat template renders each image as the model's
placeholder text (`<image>`), which tokenizes to its image token; `expand` widens each to the
`tokens_per_image` positions the encoder's features fill and records the image at them. The prompt's block hashes
then carry each image's content hash (kvrelay.common.hashing), here for routing and on the nodes for caching, in
the same way. Preprocessing and encoding happen on the prefill side (kvrelay.engine.image_inputs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx

from kvrelay.common.records import ImageInput
from kvrelay.gateway.errors import BadRequest
from kvrelay.gateway.input_limits import InputLimits
from kvrelay.model_files.vision import ImageError, VisionSpec, data_url_bytes, decode_image, expand_images


def image_urls(messages) -> list[tuple[str, str]]:
    """(param, url) of every image part of a chat, in order."""
    found = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            found.extend((f"messages[{i}].content[{j}].image_url", part.image_url.url)
                         for j, part in enumerate(m.content) if part.type == "image_url")
    return found


class ChatImages:
    """One model's image handling: `spec` None for a text-only model (any image is a 400)."""

    def __init__(self, spec: VisionSpec | None, limits: InputLimits, model: str, metrics=None) -> None:
        self.spec = spec
        self.limits = limits
        self.model = model
        self.metrics = metrics

    @property
    def placeholder(self) -> str | None:
        return None if self.spec is None else self.spec.image_token

    async def load(self, messages) -> list[bytes]:
        """Each image part's bytes, checked; BadRequest naming the part otherwise."""
        urls = image_urls(messages)
        self._check_count([param for param, _ in urls], "messages")
        return await self.check([(param, await self._fetch(param, url)) for param, url in urls])

    async def check(self, images: list[tuple[str, bytes]], where: str = "messages") -> list[bytes]:
        """Images given as bytes (param naming each, bytes), checked as `load` checks a chat's."""
        self._check_count([param for param, _ in images], where)
        cap = self.limits.max_image_bytes
        for param, data in images:
            if cap and len(data) > cap:
                raise BadRequest(f"{param}: the image exceeds {cap} bytes (--max-image-bytes)", param=param)
            try:
                await asyncio.to_thread(decode_image, data, self.limits.max_image_pixels or None)
            except ImageError as e:
                raise BadRequest(f"{param}: {e}", param=param) from None
        if images and self.metrics is not None:
            self.metrics.observe_images(len(images), sum(len(d) for _, d in images))
        return [data for _, data in images]

    def _check_count(self, params: list[str], where: str) -> None:
        if params and self.spec is None:
            raise BadRequest(f"model {self.model!r} takes no images (it has no vision encoder)", param=params[0])
        limit = self.limits.max_images_per_request
        if limit and len(params) > limit:
            raise BadRequest(f"{where}: {len(params)} images, more than the limit of {limit} "
                             "(--max-images-per-request)", param=where)

    def expand(self, tokens: Sequence[int], datas: Sequence[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The rendered prompt with each image token widened to the image's positions, and the images at them."""
        if self.spec is None:
            return list(tokens), ()
        try:
            return expand_images(tokens, self.spec, datas)
        except ValueError as e:
            raise BadRequest(f"messages: {e}; message text must not contain {self.spec.image_token!r}",
                             param="messages") from None

    async def _fetch(self, param: str, url: str) -> bytes:
        cap = self.limits.max_image_bytes
        if url.startswith("data:"):
            try:
                return data_url_bytes(url, cap)
            except ImageError as e:
                raise BadRequest(f"{param}: {e}", param=param) from None
        if not url.startswith(("http://", "https://")):
            raise BadRequest(f"{param}: give a data: URL or an http(s) URL", param=param)
        if not self.limits.allow_image_urls:
            raise BadRequest(f"{param}: image URLs are not fetched by this server (--allow-image-urls); send the "
                             "image as a data: URL", param=param)
        try:  # the whole fetch within the timeout, not each read
            return await asyncio.wait_for(self._download(param, url, cap), self.limits.image_fetch_timeout)
        except TimeoutError:
            raise BadRequest(f"{param}: fetching the image took longer than {self.limits.image_fetch_timeout:g} s "
                             "(--image-fetch-timeout)", param=param) from None

    async def _download(self, param: str, url: str, cap: int) -> bytes:
        try:
            async with httpx.AsyncClient(timeout=self.limits.image_fetch_timeout, follow_redirects=True) as client:
                async with client.stream("GET", url) as reply:
                    if reply.status_code != 200:
                        raise BadRequest(f"{param}: fetching the image gave HTTP {reply.status_code}", param=param)
                    body = bytearray()
                    async for piece in reply.aiter_bytes():
                        body += piece
                        if cap and len(body) > cap:
                            raise BadRequest(f"{param}: the image exceeds {cap} bytes (--max-image-bytes)",
                                             param=param)
                    return bytes(body)
        except httpx.HTTPError as e:
            raise BadRequest(f"{param}: could not fetch the image: {type(e).__name__}: {e}", param=param) from None
