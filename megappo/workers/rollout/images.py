"""A vision-language rollout's images beyond the prompts' own pixels (data/images.py makes those): the check that vLLM
expanded each prompt's images as the data's processor did, and the pixels of the rows your own agent sampled
(rollout.agent), whose requests may send images of their own."""

from __future__ import annotations

import numpy as np
import torch

from megappo.data.images import IMAGES, pixel_batch
from megappo.utils.images import from_data_url


def check_expanded(ids: torch.Tensor, mask: torch.Tensor, outs: list, n: int) -> None:
    """vLLM expands each image itself: its prompt must be the row's ids as the data's processor expanded them,
    or the trainer would score another prompt than the one sampled from."""
    for k, o in enumerate(outs):
        want = ids[k // n][mask[k // n]].tolist()
        if list(o.prompt_token_ids) != want:
            raise ValueError(f"prompt row {k // n}: vLLM expanded its images to {len(o.prompt_token_ids)} prompt "
                             f"tokens, the batch's row has {len(want)}: the data's image processor and vLLM's "
                             "disagree (build the prompts with the model's own processor config)")


def agent_images(trajs: list, non_tensor: dict, image_processor) -> dict:
    """The images each row of an agent's rollout holds (rollout.agent), as pixel tensors (and non_tensor IMAGES, set
    here): what its session's requests sent, in the order its ids hold them (agent/capture.Segment.images); a row
    that kept its sample's prompt and captured none (its agent failed: nothing trained) its prompt row's. {} when
    no row holds an image."""
    given = non_tensor.get(IMAGES)
    rows = [[from_data_url(u, "a captured image") for u in t.images] if t.images or t.prompt is not None
            else list(given[k]) if given is not None else [] for k, t in enumerate(trajs)]
    pixels = pixel_batch(rows, image_processor)
    if pixels is None:
        return {}
    non_tensor[IMAGES] = np.empty(len(rows), dtype=object)
    non_tensor[IMAGES][:] = rows
    return pixels
