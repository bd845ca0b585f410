"""A vision-language model's vision tower (Qwen2.5-VL) in `megappo plan`: its parameters and its activations per image
patch, from the vision_config of the role's config.json (memory_model.py states the rest of the model). Shapes only:
no torch. h is vision_config's hidden_size, f its intermediate_size, m its spatial_merge_size, out its out_hidden_size.

- Where it sits: on the first pipeline stage, whole on every TP rank (models/vision_gpt.py): its parameters join
  stage 0's and are not divided by tp (with it the first stage is the worst one). The config.json is model.path's
  (the actor, the reference), model.critic_path's (else model.path's) for the critic and teacher.model's for a
  teacher; a role without one at hand, or with a text model's, is planned as its language model alone.
- Parameters: the patch embedding (a conv without bias, C * T * p^2 * h: in_channels, temporal_patch_size,
  patch_size), per block two RMSNorms (2h), qkv and proj with biases (4h^2 + 4h) and the gated MLP with biases
  (3hf + 2f + h), the merger's RMSNorm (h) and its two biased linears (h m^2 -> h m^2 -> out): `vision_params`,
  equal to the module's own tensors (models/vision.vision_tensors; tests/test_planner.py checks it).
- Trained or frozen: a trained role (the actor, a critic of a VL model) holds bf16 weights + fp32 grads + Adam for
  the tower as for its other dense parameters, except with model.freeze_vision or LoRA (apply_lora freezes every
  base parameter): bf16 weights only. The reference and a teacher hold weights only. vLLM's copy is split over
  rollout TP (its parallel linears), and the weight sync carries it.
- Patches: a row holds m^2 image patches per image-pad token, and data.max_image_tokens of those (null:
  data.max_prompt_length, every prompt token an image's: the bound), so a micro-batch of b rows holds
  b * m^2 * max_image_tokens patches (`image_patches`).
- Activations, bf16, per patch: what autograd keeps of transformers' module for the backward, measured with
  torch.autograd.graph.saved_tensors_hooks (the distinct storages it keeps besides the parameters, at two widths and
  two FFN sizes: exact on CPU's SDPA; tests/test_planner.py measures the tiny tower again): per block
  30h + 8f + 4 * num_heads + 8 bytes, windowed and full-attention blocks alike (SDPA's fused kernel keeps no scores,
  so window_size and fullatt_block_indexes do not enter), plus 2 * C * T * p^2 (the pixels the patch embedding
  keeps), 12h (the merger), 8h / num_heads (the 2-D RoPE's fp32 cos and sin) and 8 (the merger norm's fp32 rsqrt,
  the window order's index). Megatron's recompute does not reach the tower (it runs before the decoder), and 1F1B
  keeps the in-flight micro-batches' on stage 0. A frozen tower keeps nothing for a backward: its forward's peak is
  counted as one block's kept bytes (an upper bound).
"""

from __future__ import annotations

import json
from pathlib import Path

from megappo.config import ConfigError
from megappo.parallel.model_dims import VISION_MODEL_TYPES

NEEDED = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
          "spatial_merge_size", "temporal_patch_size")


def vision_config(cfg, role: str) -> dict | None:
    """The role's vision_config from its model dir's config.json; None: a text model, or no config.json at hand."""
    path = {"critic": cfg.model.critic_path or cfg.model.path, "teacher": cfg.teacher.model}.get(role, cfg.model.path)
    hf = Path(path) / "config.json" if path else None
    if hf is None or not hf.is_file():
        return None
    raw = json.loads(hf.read_text())
    if raw.get("model_type") not in VISION_MODEL_TYPES:
        return None
    vc = raw.get("vision_config") or {}
    missing = [k for k in NEEDED if k not in vc]
    if missing:
        raise ConfigError(f"{hf}: vision_config lacks {', '.join(missing)}; use the checkpoint's own config.json")
    return vc


def _pixels(vc: dict) -> int:
    """One patch's pixel values: in_channels (older config.json files: in_chans) x T x p x p."""
    return vc.get("in_channels", vc.get("in_chans", 3)) * vc["temporal_patch_size"] * vc["patch_size"] ** 2


def vision_params(vc: dict | None) -> int:
    """The tower's and merger's parameters (0 without a tower)."""
    if not vc:
        return 0
    h, f, out, merged = vc["hidden_size"], vc["intermediate_size"], vc["out_hidden_size"], \
        vc["hidden_size"] * vc["spatial_merge_size"] ** 2
    block = 2 * h + 4 * h * h + 4 * h + 3 * h * f + 2 * f + h
    merger = h + merged * merged + merged + merged * out + out
    return _pixels(vc) * h + vc["depth"] * block + merger


def patch_bytes(vc: dict, trained: bool) -> int:
    """Bytes per image patch: what a trained tower keeps for its backward, or a frozen one's forward peak."""
    h, f, heads = vc["hidden_size"], vc["intermediate_size"], vc["num_heads"]
    block = 30 * h + 8 * f + 4 * heads + 8
    if not trained:
        return block
    return vc["depth"] * block + 2 * _pixels(vc) + 12 * h + 8 * (h // heads) + 8


def image_tokens(cfg) -> int:
    """data.max_image_tokens (null: data.max_prompt_length), or a one-line refusal of a count no sample holds."""
    n, most = cfg.data.max_image_tokens, cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if n is None:
        return cfg.data.max_prompt_length
    if not 0 <= n <= most:
        raise ConfigError(f"data.max_image_tokens={n} must be in 0..{most} (a sample's tokens, prompt + response); "
                          "set the most image-pad tokens one sample holds, or null for data.max_prompt_length")
    return n


def image_patches(cfg, vc: dict, rows: int) -> int:
    """The image patches `rows` rows of a micro-batch hold at most."""
    return rows * vc["spatial_merge_size"] ** 2 * image_tokens(cfg)


def vision_activation_bytes(cfg, vc: dict | None, rows: int, trained: bool) -> int:
    """The tower's activations for one micro-batch of `rows` rows (0 without a tower)."""
    return image_patches(cfg, vc, rows) * patch_bytes(vc, trained) if vc else 0
