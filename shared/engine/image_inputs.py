"""Image features for a step's placeholder tokens: decode, preprocess and encode each image once, on the side that
computes its prompt (a prefill node, or a colocated one), and hand the model the rows its features replace.

A request's image may span several steps (chunked prefill) or start inside a prefix-cache hit: its features are
computed when its first uncached position is scheduled and kept until its last one is, then dropped. Every image
a step needs is encoded in one batch. The time goes into the step, hence into TTFT; `stats` counts it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvrelay.common.hashing import image_hash
from kvrelay.common.records import ImageInput
from kvrelay.model_files.vision import ImageError, VisionSpec, decode_image, preprocess


def checked_images(spec: VisionSpec | None, architecture: str, prompt: Sequence[int], images: Sequence[ImageInput],
                   decode: bool = True) -> tuple[ImageInput, ...]:
    """A request's images with their content hashes, each checked to sit on exactly its placeholder tokens, every
    placeholder covered, and (`decode`) to be an image; ValueError naming what is wrong (nothing is held yet)."""
    if spec is None:
        if images:
            raise ValueError(f"images: {architecture} takes no images")
        return ()
    out: list[ImageInput] = []
    end = 0
    for im in images:
        if im.length != spec.tokens_per_image or im.offset < end or im.end > len(prompt):
            raise ValueError(f"images: an image takes {spec.tokens_per_image} placeholder tokens in order; got "
                             f"positions [{im.offset}, {im.end}) in a prompt of {len(prompt)}")
        if any(t != spec.image_token_id for t in prompt[im.offset : im.end]):
            raise ValueError(f"images: positions [{im.offset}, {im.end}) are not all image tokens")
        if decode:
            try:
                decode_image(im.data)
            except ImageError as e:
                raise ValueError(f"images: {e}") from None
        out.append(replace(im, content_hash=image_hash(im.data)))
        end = im.end
    placeholders = sum(1 for t in prompt if t == spec.image_token_id)
    if placeholders != len(out) * spec.tokens_per_image:
        raise ValueError(f"images: the prompt has {placeholders} image tokens for {len(out)} images of "
                         f"{spec.tokens_per_image}")
    return tuple(out)


@dataclass
class ImageStats:
    images_encoded: int = 0
    encoder_seconds: float = 0.0  # decode, preprocess and encode, together


class ImageEncoder:
    """`model` has encode_images(pixels [n, 3, H, W]) -> features [n, tokens, hidden] (models/llava.py)."""

    def __init__(self, model, spec: VisionSpec, device: torch.device) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self._features: dict[tuple[str, int], torch.Tensor] = {}  # (request, image index) -> [tokens, hidden]
        self.stats = ImageStats()

    def rows(self, spans: Sequence[tuple[str, Sequence[ImageInput], int, int, int]]
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For attention rows (request, its images, first flat row, first position, positions this step): the flat
        rows that are image positions and their features, or None when no row holds one."""
        wanted = []  # (request, image index, image, first position used, end, flat row of that position)
        for rid, images, flat, start, count in spans:
            end = start + count
            for i, im in enumerate(images):
                lo, hi = max(start, im.offset), min(end, im.end)
                if lo < hi:
                    wanted.append((rid, i, im, lo, hi, flat + lo - start))
        if not wanted:
            return None
        self._encode([(rid, i, im) for rid, i, im, *_ in wanted if (rid, i) not in self._features])
        rows, feats = [], []
        for rid, i, im, lo, hi, flat in wanted:
            rows.append(np.arange(flat, flat + hi - lo))
            feats.append(self._features[rid, i][lo - im.offset : hi - im.offset])
            if hi == im.end:  # its last position is computed this step
                self._features.pop((rid, i), None)
        return torch.from_numpy(np.concatenate(rows)).to(self.device), torch.cat(feats)

    def drop(self, rid: str) -> None:
        """A request finished or was preempted: its features go (a resumed request encodes again)."""
        for key in [k for k in self._features if k[0] == rid]:
            del self._features[key]

    def _encode(self, todo: list[tuple[str, int, ImageInput]]) -> None:
        if not todo:
            return
        t0 = time.perf_counter()
        # Decodable: checked_images decoded each when its request was added (a decode node's reservation, on the
        # prefill node that computed it), so nothing here fails for bad input.
        pixels = np.stack([preprocess(decode_image(im.data), self.spec) for _, _, im in todo])
        feats = self.model.encode_images(torch.from_numpy(pixels).to(self.device))
        for (rid, i, _), f in zip(todo, feats, strict=True):
            self._features[rid, i] = f
        self.stats.images_encoded += len(todo)
        self.stats.encoder_seconds += time.perf_counter() - t0
