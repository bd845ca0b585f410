"""A prompt's images, for a vision-language model: the parquet `images` column read into encoded bytes, the prompt's
messages given image parts, and a batch's pixels as the model's image processor makes them.

`images` column (optional): per row a list of images, each the encoded bytes (PNG, JPEG, ...), a dict with "bytes"
or "path" (Hugging Face datasets' Image feature), or a path (relative to the parquet file's directory). Remote URLs
are refused: nothing is fetched. The prompt marks where each image goes with an image part ({"type": "image"}) or
the text "<image>" (verl's convention); a prompt with neither gets its images first in its first user message.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional

import torch

from megappo.utils.images import data_url, decode  # noqa: F401 (decode: re-exported)

IMAGE_MARKER = "<image>"
IMAGES = "images"  # the parquet column, a row's key and the batch's non_tensor key: each row's images (encoded bytes)


def read_images(value: Any, base_dir: Path, where: str) -> list[bytes]:
    """A parquet cell of the `images` column -> the images' encoded bytes (see the module docstring)."""
    if value is None:
        return []
    items = [value] if isinstance(value, (bytes, str, dict)) else list(value)
    out = []
    for k, item in enumerate(items):
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray)):
            out.append(bytes(item))
            continue
        if not isinstance(item, str) or not item:
            raise ValueError(f"{where}: image {k} is {type(item).__name__}; store encoded bytes, {{'bytes': ...}} "
                             "or a file path")
        if "://" in item:
            raise ValueError(f"{where}: image {k} is a URL ({item[:60]}); megappo fetches nothing: download the "
                             "images and store their bytes or paths")
        path = Path(item) if Path(item).is_absolute() else base_dir / item
        if not path.is_file():
            raise ValueError(f"{where}: image {k} {str(path)!r} is not a file; store paths relative to the parquet "
                             "file's directory, or the bytes")
        out.append(path.read_bytes())
    return out








def with_image_urls(prompt: Any, images: list[bytes], where: str) -> list[dict]:
    """A row's prompt as the chat messages an OpenAI client sends: its images (with_image_parts' places) as image_url
    parts with data URLs, in order (what an agent under rollout.agent is given: gateway/agents.sample_rows)."""
    urls = iter([data_url(b) for b in images])
    messages = with_image_parts(prompt, len(images), where)
    for m in messages:
        if isinstance(m["content"], list):
            m["content"] = [{"type": "image_url", "image_url": {"url": next(urls)}} if p.get("type") == "image" else p
                            for p in m["content"]]
    return messages




def processor_for(model_path):
    """A vision-language model's HF processor (its image processor and tokenizer), or None for a text model."""
    import json

    from megappo.parallel.model_dims import VISION_MODEL_TYPES

    config = Path(model_path) / "config.json"
    if not config.is_file() or json.loads(config.read_text()).get("model_type") not in VISION_MODEL_TYPES:
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_path))




def with_image_parts(prompt: Any, count: int, where: str) -> list[dict]:
    """Chat messages (or a string: one user message) whose images are content parts: "<image>" in a text becomes an
    image part there; without any marker the images go first in the first user message. The parts must match
    `count`."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    marked = 0
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            pieces = content.split(IMAGE_MARKER)
            parts = [p for k, piece in enumerate(pieces)
                     for p in ([{"type": "image"}] if k else []) + ([{"type": "text", "text": piece}] if piece else [])]
            m["content"] = parts if len(pieces) > 1 else content
            marked += len(pieces) - 1
        else:
            marked += sum(1 for p in content if p.get("type") in ("image", "image_url"))
    if marked == 0 and count:
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            raise ValueError(f"{where}: {count} image(s) but no user message to put them in")
        text = first["content"]
        text = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
        first["content"] = [{"type": "image"} for _ in range(count)] + text
    elif marked != count:
        raise ValueError(f"{where}: the prompt marks {marked} image(s), the row has {count} in its images column: "
                         f"give each image one {IMAGE_MARKER} (or image part), or mark none")
    return messages


def pixel_batch(rows: list[list[bytes]], image_processor) -> Optional[dict[str, torch.Tensor]]:
    """Each row's images through the model's image processor -> {"pixel_values" [B, P, D], "image_grid_thw"
    [B, I, 3]} (models/vision.py's layout: zeros past a row's own), or None when no row has an image."""
    images = [decode(b) for row in rows for b in row]
    if not images:
        return None
    got = image_processor(images=images, return_tensors="pt")
    grids, pixels = got["image_grid_thw"].long(), got["pixel_values"]
    counts, sizes, at = [len(r) for r in rows], [], 0
    per_image = grids.prod(-1).tolist()
    for n in counts:
        sizes.append(sum(per_image[at:at + n]))
        at += n
    out_pixels = torch.zeros(len(rows), max(sizes), pixels.shape[-1], dtype=pixels.dtype)
    out_grids = torch.zeros(len(rows), max(counts), 3, dtype=torch.long)
    image = patch = 0
    for r, (n, size) in enumerate(zip(counts, sizes)):
        out_pixels[r, :size] = pixels[patch:patch + size]
        out_grids[r, :n] = grids[image:image + n]
        image, patch = image + n, patch + size
    return {"pixel_values": out_pixels, "image_grid_thw": out_grids}
