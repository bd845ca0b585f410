"""The tiny vision-language asset: a random Qwen2.5-VL (`make_vl_model`) with the project's tiny tokenizer plus
Qwen2.5-VL's vision tokens, an image processor that keeps small images small, and a chat template that writes an
image part as Qwen's placeholder run. Built offline from a config, like assets.py's text models; tests and the
vision recipe (docs/vision.md) use it.

Shapes: the language model is assets.TINY_SHAPES' (head_dim 32, M-RoPE sections [4, 6, 6] of its 16 frequency
pairs); the vision tower has 2 blocks of width 64 (2 heads of 32; the second with full attention, the first
windowed) and merges 2 x 2 patches of 14 px into one token of the language model's width. A 112 x 112 image is
8 x 8 patches, 16 tokens.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Qwen2.5-VL's tokens around an image's run of <|image_pad|> (one per merged patch), in its tokenizer's names
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MROPE_SECTION = [4, 6, 6]  # temporal, height, width frequency pairs of head_dim 32
VISION_SHAPES = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1])
# images are resized to a multiple of 28 px between these areas: 56 x 56 (4 tokens) to 224 x 224 (64 tokens)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224
# ChatML whose content is a string or a list of parts ({"type": "image"} / {"type": "text", "text": ...}), an image
# written as Qwen2.5-VL's template writes it
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_vl_model(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Save a tiny random Qwen2.5-VL (fp32 safetensors in the hub's names: `model.*`, `visual.*`, `lm_head`) with
    its tokenizer, processor and generation config into `out_dir`."""
    import torch
    from transformers import (AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    from megappo.assets import TINY_SHAPES, init_tiny_weights

    out = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(TINY_SHAPES, vocab_size=len(tok), rms_norm_eps=1e-6, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": MROPE_SECTION})
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=dict(VISION_SHAPES, out_hidden_size=text["hidden_size"]),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                           tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32)
    init_tiny_weights(model)
    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                            patch_size=VISION_SHAPES["patch_size"],
                                            merge_size=VISION_SHAPES["spatial_merge_size"],
                                            temporal_patch_size=VISION_SHAPES["temporal_patch_size"])
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok,
                                    video_processor=Qwen2VLVideoProcessor(), chat_template=VL_CHAT_TEMPLATE)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def square_image(size: int = 112, seed: int = 0):
    """A deterministic RGB test image (PIL): coloured blocks on noise, so patches differ."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


if __name__ == "__main__":  # python -m megappo.vision_assets OUT TOKENIZER_DIR
    import sys

    with tempfile.TemporaryDirectory():
        print(make_vl_model(sys.argv[1], sys.argv[2]))
