"""What a vision-language model folder says about images, and turning an image's bytes into its pixel values.

A LLaVA-layout folder (config.json `vision_config`, `image_token_index`; the processor's `image_processor` in
processor_config.json or preprocessor_config.json) takes each image as `tokens_per_image` copies of its image
token in the prompt; the vision encoder's features replace those tokens' embeddings. The gateway reads the spec
to expand a chat's images into placeholder tokens and to refuse bad images early; the prefill side preprocesses
and encodes. Preprocessing follows transformers' CLIP image processor (PIL backend) step for step: RGB, resize
the shortest edge (bicubic), centre crop, rescale, normalise; tests check it against transformers' own.

Also `text_config`: the language model's part of a config.json (itself for a text-only model), and
`expand_images`: a rendered prompt's image tokens widened to their images' positions (the gateway and `LLM` alike).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.common.hashing import image_hash
from kvrelay.common.records import ImageInput

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


class ImageError(ValueError):
    """An image the server cannot take: undecodable, too large, or for a model without a vision encoder."""


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int
    image_token: str  # the placeholder's text ("<image>")
    tokens_per_image: int
    shortest_edge: int  # resize target of the shorter side
    crop: tuple[int, int]  # (height, width) after the centre crop
    resample: int  # PIL's resampling filter
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` of a vision-language config.json, else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def vision_spec(model_dir: str | Path) -> VisionSpec | None:
    """The folder's image handling; None for a text-only model."""
    folder = Path(model_dir)
    config = _json(folder / "config.json")
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if token_id is None:
        raise ImageError(f"{folder}/config.json: a vision_config without image_token_index")
    proc = _json(folder / "processor_config.json")
    image = proc.get("image_processor") or _json(folder / "preprocessor_config.json")
    image_size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 14))
    size = image.get("size") or {"shortest_edge": image_size}
    crop = image.get("crop_size") or {"height": image_size, "width": image_size}
    if isinstance(crop, int):
        crop = {"height": crop, "width": crop}
    if (int(crop["height"]), int(crop["width"])) != (image_size, image_size):
        raise ImageError(f"{folder}: crop size {crop} differs from the encoder's image_size {image_size}")
    strategy = config.get("vision_feature_select_strategy", "default")
    return VisionSpec(
        image_token_id=int(token_id),
        image_token=str(proc.get("image_token", "<image>")),
        tokens_per_image=(image_size // patch) ** 2 + (0 if strategy == "default" else 1),
        shortest_edge=int(size.get("shortest_edge", size.get("height", image_size))),
        crop=(int(crop["height"]), int(crop["width"])),
        resample=int(image.get("resample", _BICUBIC)),
        rescale_factor=float(image.get("rescale_factor", 1 / 255)),
        mean=tuple(image.get("image_mean", _CLIP_MEAN)),  # type: ignore[arg-type]
        std=tuple(image.get("image_std", _CLIP_STD)),  # type: ignore[arg-type]
        do_resize=bool(image.get("do_resize", True)),
        do_center_crop=bool(image.get("do_center_crop", True)),
        do_rescale=bool(image.get("do_rescale", True)),
        do_normalize=bool(image.get("do_normalize", True)),
    )


def data_url_bytes(url: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a base64 data: URL (data:image/png;base64,...); ImageError when it is not one, or when it holds
    more than `max_bytes` (checked before decoding)."""
    header, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or not header.endswith(";base64"):
        raise ImageError("a data URL must be base64 (data:image/png;base64,...)")
    if max_bytes and len(payload) * 3 // 4 > max_bytes:
        raise ImageError(f"the image exceeds {max_bytes} bytes (--max-image-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL is not valid base64") from None


def decode_image(data: bytes, max_pixels: int | None = None):
    """The decoded image (a PIL image, RGB); ImageError when it is not an image or has more than `max_pixels`."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise ImageError(f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels")
        image.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"could not decode the image: {e}") from None
    return _to_rgb(image)


def _to_rgb(image):
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "P") and ("A" in image.getbands() or "transparency" in image.info):
        rgba = image.convert("RGBA")  # transparent pixels onto white, as transformers does
        background = Image.new("RGBA", rgba.size, (255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image, spec: VisionSpec) -> np.ndarray:
    """An RGB PIL image -> float32 pixel values [3, crop height, crop width], as the encoder takes them."""
    if spec.do_resize:
        width, height = image.size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = spec.shortest_edge, int(spec.shortest_edge * long / short)
        size = (new_short, new_long) if width <= height else (new_long, new_short)
        if size != image.size:
            image = image.resize(size, resample=spec.resample)
    pixels = np.asarray(image, dtype=np.uint8)  # [H, W, 3]
    if spec.do_center_crop:
        (ch, cw), (h, w) = spec.crop, pixels.shape[:2]
        if h < ch or w < cw:
            raise ImageError(f"image of {w}x{h} is smaller than the crop {cw}x{ch} after resizing")
        top, left = (h - ch) // 2, (w - cw) // 2
        pixels = pixels[top : top + ch, left : left + cw]
    out = pixels.transpose(2, 0, 1)
    values = (out.astype(np.float64) * spec.rescale_factor).astype(np.float32) if spec.do_rescale else \
        out.astype(np.float32)
    if spec.do_normalize:
        mean = np.asarray(spec.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(spec.std, dtype=np.float32)[:, None, None]
        values = (values - mean) / std
    return np.ascontiguousarray(values, dtype=np.float32)


def expand_images(tokens: Sequence[int], spec: VisionSpec, datas: Sequence[bytes]
                  ) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A rendered prompt with each image token widened to its image's `tokens_per_image` positions, and the images
    (bytes, content hash) at them, in order; ValueError when the image tokens and the images do not pair up."""
    token, width = spec.image_token_id, spec.tokens_per_image
    count = sum(1 for t in tokens if t == token)
    if count != len(datas):
        raise ValueError(f"the prompt has {count} image placeholders ({spec.image_token}) for {len(datas)} images")
    out: list[int] = []
    images = []
    for t in tokens:
        if t == token:
            data = datas[len(images)]
            images.append(ImageInput(offset=len(out), length=width, data=data, content_hash=image_hash(data)))
            out.extend([token] * width)
        else:
            out.append(t)
    return out, tuple(images)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
