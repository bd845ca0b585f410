"""Images as chat requests carry them (OpenAI image_url parts with data URLs) and as a vision-language model's
prompt holds them (each image one <|image_pad|> as a chat template writes it, expanded into the run its processor
gives it). Below every layer that reads them: the data (data/images.py), the token capture (agent/capture.py), the
gateway and the rollout."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any


def decode(data: bytes):
    """Encoded bytes -> an RGB PIL image."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    return image.convert("RGB") if image.mode != "RGB" else image


def from_data_url(url: Any, where: str) -> bytes:
    """An OpenAI image part's URL -> the image's encoded bytes: a data URL (data:image/...;base64,...) only; a remote
    URL is refused (nothing is fetched)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: an image_url part needs its url, a data URL (data:image/png;base64,...)")
    if not url.startswith("data:"):
        raise ValueError(f"{where}: the image URL {url[:60]!r} is not a data URL; megappo fetches nothing: send the "
                         "image inline as data:image/png;base64,...")
    head, _, payload = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError(f"{where}: {head[:60]!r} is not an image data URL; send data:image/<format>;base64,<bytes>")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise ValueError(f"{where}: the image data URL's payload is not base64") from None


def data_url(data: bytes) -> str:
    """Encoded image bytes as a data URL (an OpenAI image_url part's url), its MIME type from the image itself."""
    from PIL import Image

    kind = (Image.open(io.BytesIO(data)).format or "png").lower()
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_urls(messages: list[dict]) -> list[str]:
    """The URLs of chat messages' image_url parts, in order."""
    urls = []
    for m in messages:
        for p in m.get("content") if isinstance(m.get("content"), list) else ():
            if isinstance(p, dict) and p.get("type") == "image_url":
                url = p.get("image_url")
                urls.append(url.get("url") if isinstance(url, dict) else url)
    return urls


def expand_pads(ids: list[int], images: list[bytes], processor, where: str) -> list[int]:
    """A rendered prompt's ids (each image as one <|image_pad|>, as a chat template writes it) with each pad expanded
    into the run the model's processor gives that image (what vLLM makes of it, and what the trainer scores)."""
    pad = processor.image_token_id
    at = [k for k, t in enumerate(ids) if t == pad]
    if len(at) != len(images):
        raise ValueError(f"{where}: the rendered prompt holds {len(at)} image placeholder(s) for {len(images)} "
                         "image(s); do not write <|image_pad|> in a message's text")
    if not images:
        return list(ids)
    grids = processor.image_processor(images=[decode(b) for b in images], return_tensors="pt")["image_grid_thw"]
    runs = (grids.prod(-1) // processor.image_processor.merge_size ** 2).tolist()
    out, last = [], 0
    for k, n in zip(at, runs):
        out += list(ids[last:k]) + [pad] * int(n)
        last = k + 1
    return out + list(ids[last:])
