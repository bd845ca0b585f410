"""Images in a batch, for a vision-language model (Qwen2.5-VL): what the rows carry, the M-RoPE positions they give
their tokens, and the model call's image inputs. Pure torch; the model is models/vision_gpt.py.

A row carries its images beside its tokens, so they travel with it through dispatch, micro-batches and packing:
- `pixel_values` [B, P, C * T * 14 * 14]: the row's images' patches as the HF image processor flattens them, one
  image after another, zeros past the row's last patch (P: the batch's most);
- `image_grid_thw` [B, I, 3]: each image's (t, h, w) in patches, in the row's order; zero rows past its images.
The row's prompt holds each image as the processor expands it: <|vision_start|>, (t * h * w / merge^2) x
<|image_pad|>, <|vision_end|>. An image pad the policy samples is text: only the runs it did not sample (the prompt's,
and an agent's later messages between its turns: rollout.agent) take the tower's features (`_image_mask`).
"""

from __future__ import annotations

from typing import Optional

import torch

IMAGE_KEYS = ("pixel_values", "image_grid_thw")  # a row's images (whole per row: never cut to a window)
IMAGE_MASK = "_image_mask"  # [B, S] bool: the prompt tokens that take an image feature (engine-made, per token)


def vision_tower(vision_config, dtype: torch.dtype):
    """transformers' Qwen2.5-VL vision tower + merger (Qwen2_5_VisionTransformerPretrainedModel), built from the
    checkpoint's vision_config; its weights are the caller's `visual.*` copy."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config, dtype=dtype)


def vision_tensors(hf_config) -> dict[str, tuple]:
    """{`visual.*` name: shape} of the vision tower's weights, from the module itself (built on the meta device)."""
    from megappo.parallel.model_dims import VISION_PREFIX

    with torch.device("meta"):
        tower = vision_tower(hf_config.vision_config, torch.float32)
    return {VISION_PREFIX + k: tuple(v.shape) for k, v in tower.state_dict().items()}


def image_runs(ids: torch.Tensor, image_token_id: int, sampled: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of image pads of a row that the policy did not sample (`sampled`: bool per id)."""
    pads = torch.zeros(len(ids) + 2, dtype=torch.int8)
    pads[1:-1] = (ids == image_token_id) & ~sampled
    edges = torch.diff(pads.to(torch.int16))
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def collapsed(ids: list[int], image_token_id: int) -> list[int]:
    """A prompt's ids with each run of image pads as one pad: what vLLM is sent beside the images (it expands each
    image itself, and would expand an expanded run again)."""
    return [t for k, t in enumerate(ids) if t != image_token_id or k == 0 or ids[k - 1] != image_token_id]


def mrope_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
                    image_token_id: int, merge: int, prompt_end: int,
                    response_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's M-RoPE positions [B, S, 3] (temporal, height, width) of left-padded rows, and the image mask
    [B, S]: text tokens count up on all three axes; an image's tokens sit at the running position plus their
    (t, y, x) in its merged grid, and the text after it resumes max(h, w) / merge later (transformers'
    Qwen2_5_VLModel.get_rope_index for images; videos are not supported; vLLM's positions of a multi-turn prompt
    follow the same rule). `prompt_end`: the column where the responses begin; image pads from there on are text
    where `response_mask` [B, S - prompt_end] is 1 (sampled) or not given (the whole response is). Padding gets
    position 0."""
    b, s = input_ids.shape
    positions = torch.zeros(b, s, 3, dtype=torch.long)
    where = torch.zeros(b, s, dtype=torch.bool)
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    grids = image_grid_thw.cpu() if image_grid_thw is not None else torch.zeros(b, 0, 3, dtype=torch.long)
    sampled = torch.zeros(b, s, dtype=torch.bool)
    sampled[:, prompt_end:] = True if response_mask is None else response_mask.cpu().bool()
    for r in range(b):
        cols = mask[r].nonzero().flatten()
        images = [g for g in grids[r].tolist() if g[0] > 0]
        runs = image_runs(ids[r, cols], image_token_id, sampled[r, cols])
        if len(runs) != len(images):
            raise ValueError(f"row {r}: its prompt holds {len(runs)} image placeholder runs, its image_grid_thw "
                             f"{len(images)} images: build the prompt with the model's processor (each image as "
                             "<|vision_start|>, its <|image_pad|> run, <|vision_end|>)")
        row = torch.zeros(len(cols), 3, dtype=torch.long)
        at = cur = 0
        for (start, length), (t, h, w) in zip(runs, images):
            hh, ww = h // merge, w // merge
            if length != t * hh * ww:
                raise ValueError(f"row {r}: an image of grid ({t}, {h}, {w}) takes {t * hh * ww} <|image_pad|> "
                                 f"tokens, its prompt has {length}: build the prompt with the model's processor")
            row[at:start] = torch.arange(start - at)[:, None] + cur
            cur += start - at
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(hh), torch.arange(ww), indexing="ij"), -1)
            row[start:start + length] = grid.reshape(-1, 3) + cur
            where[r, cols[start:start + length]] = True
            cur += max(hh, ww)
            at = start + length
        row[at:] = torch.arange(len(cols) - at)[:, None] + cur
        positions[r, cols] = row
    return positions.to(input_ids.device), where.to(input_ids.device)


def images_of(mb: dict) -> dict:
    """A micro-batch's image inputs for the model call: {"images": (patches [N, D], grids [n, 3], where [b, s])}
    (its rows' images in row order, which is also the order of their pads in a packed row), or {}."""
    if "pixel_values" not in mb:
        return {}
    grids, pixels = mb["image_grid_thw"], mb["pixel_values"]
    patches, kept = [], []
    for r in range(grids.shape[0]):
        real = grids[r][grids[r, :, 0] > 0]
        patches.append(pixels[r, :int(real.prod(-1).sum())])
        kept.append(real)
    return {"images": (torch.cat(patches), torch.cat(kept), mb[IMAGE_MASK].bool())}
