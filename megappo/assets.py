"""Tiny, deterministic assets for tests and the CPU demo: no model hub, nothing downloaded.

- `make_tokenizer(dir)`: a byte-level BPE (trained with `tokenizers` on a fixed corpus) wrapped in
  `PreTrainedTokenizerFast` with a ChatML chat template; AutoTokenizer loads it offline.
- `make_model(dir, family)`: a tiny randomly initialised llama / qwen2 / mistral / qwen3 HF model saved as
  safetensors next to a copy of that tokenizer. Head dim is 32 (vLLM's CPU attention rejects 16) and
  the vocab (TOKENIZER_VOCAB) is deliberately not a multiple of 128, so padded-vocab code paths run.

- `make_vl_model(dir, tokenizer_dir)`: a tiny random Qwen2.5-VL. Its language model has TINY_SHAPES (M-RoPE
  sections [4, 6, 6] of head_dim 32's 16 frequency pairs), its vision tower 2 blocks of width 64 (the second with
  full attention) merging 2 x 2 patches of 14 px into one token: a 112 x 112 image is 16 tokens. The tokenizer is
  the tiny one plus Qwen2.5-VL's vision tokens; its processor keeps small images small.

- `make_arith_sft_model(dir, base)`, `make_code_sft_model(dir, base)`: the CPU demo's and the code recipe's warm
  starts, each a short SFT (`sft_chat`; see their docstrings).

`megappo assets --out DIR [--demo]` builds them (idempotent: an existing, complete dir is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

TOKENIZER_VOCAB = 1000  # BPE size incl. special tokens; 1000 % 128 != 0 on purpose (padded-vocab paths)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Shapes of the tiny models. head_dim = hidden / heads = 32.
TINY_SHAPES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3",
            "deepseek_v3_lite")  # deepseek_v3_lite: model_type deepseek_v3 without q_lora_rank (V2-Lite's attention)
# families added for 2026's MoE models: a model vocabulary one past the tokenizer's (odd, and padded) and
# routers whose logits are spread (std ROUTER_STD), so no top-k choice is a near-tie between fp32 implementations
ODD_VOCAB_FAMILIES = ("qwen2_moe", "glm4_moe", "deepseek_v3", "deepseek_v3_lite")
ROUTER_STD = 0.5
# a sigmoid router (GLM-4.5, DeepSeek-V3) saturates at that spread: scores of 1.0 in fp32, and group scores
# (sums of a group's top-2) tied to 1e-7; this keeps the scores inside (0, 1), the bias deciding between them
SIGMOID_ROUTER_STD = 0.1


def _corpus(seed: int = 0) -> list[str]:
    """A fixed corpus: English-ish words, arithmetic (the synthetic task), chat markup."""
    rng = random.Random(seed)
    words = (
        "the a of to and in is it you that he was for on are with as his they be at one have this from "
        "or had by word but what some we can out other were all there when up use your how said an each "
        "she which do their time if will way about many then them write would like so these her long make "
        "thing see him two has look more day could go come did number sound no most people my over know "
        "water than call first who may down side been now find answer question solve compute what is plus "
        "minus times equals result think step final"
    ).split()
    lines = []
    for _ in range(3000):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + ".")
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        res = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"What is {a} {op} {b}? The answer is {res}. #### {res}")
    return lines


def make_tokenizer(out_dir: str | os.PathLike) -> Path:
    """Train and save the tiny tokenizer into `out_dir` (tokenizer.json + config files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # PPO prompts are left-padded for generation
    )
    fast.save_pretrained(out)
    return out


def _hf_config(family: str, vocab_size: int, eos_id: int, pad_id: int, **overrides):
    from transformers import (DeepseekV3Config, Glm4MoeConfig, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig)

    vocab_size += family in ODD_VOCAB_FAMILIES
    common = dict(TINY_SHAPES, vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    if family == "llama":
        cfg = LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    elif family == "qwen3":  # q/k norms, and head_dim 64 != hidden / heads (32), as Qwen3 sizes have
        cfg = Qwen3Config(**common, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                          attention_bias=False, use_sliding_window=False)
    elif family == "qwen3_moe":  # 4 experts, top-2, renormalised; layer 0 dense (mlp_only_layers), 1-3 routed
        cfg = Qwen3MoeConfig(**common, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                             mlp_only_layers=[0], norm_topk_prob=True, use_sliding_window=False)
    elif family == "mixtral":  # every layer routed: 4 experts of intermediate_size, top-2 renormalised
        cfg = MixtralConfig(**common, rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
                            num_local_experts=4, num_experts_per_tok=2, sliding_window=None, router_jitter_noise=0.0)
    elif family == "qwen2_moe":  # every layer routed: 4 experts top-2, not renormalised; a gated shared expert
        cfg = Qwen2MoeConfig(**common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[],
                             norm_topk_prob=False, qkv_bias=True, use_sliding_window=False)
    elif family == "glm4_moe":  # GLM-4.5's shape: layer 0 dense, then 8 experts under a sigmoid router with a
        # correction bias, top-2 renormalised and scaled 2.5, one shared expert; q/k/v biases, q/k norms, RoPE on
        # half of each head (16 of 32); no MTP layer (a real checkpoint's is skipped)
        cfg = Glm4MoeConfig(**common, head_dim=32, rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
                            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                            first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                            norm_topk_prob=True, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                            num_nextn_predict_layers=0)
    elif family in ("deepseek_v3", "deepseek_v3_lite"):  # DeepSeek-V3's shape: multi-latent attention with the
        # rank vLLM's CPU MLA kernel needs (kv_lora 512, RoPE dims 64; q through a rank-64 latent, or a plain q_proj
        # for _lite), YaRN with its mscale; layer 0 dense, then 8 experts in 2 groups (the best group, then top-2
        # in it) under the sigmoid router with its correction bias, scaled 2.5, one shared expert
        cfg = DeepseekV3Config(**dict(common, num_key_value_heads=4), rms_norm_eps=1e-6, tie_word_embeddings=False,
                               q_lora_rank=None if family == "deepseek_v3_lite" else 64, kv_lora_rank=512,
                               qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8,
                               num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=64,
                               n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                               norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
                               num_nextn_predict_layers=0, rope_theta=10000.0,
                               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    elif family == "mistral":
        cfg = MistralConfig(**common, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                            sliding_window=None)
    else:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_model(out_dir: str | os.PathLike, family: str = "llama", seed: int = 0, tokenizer_dir=None,
               **config_overrides) -> Path:
    """Save a tiny random `family` causal LM (fp32 safetensors) plus its tokenizer into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tokenizer_dir) if tokenizer_dir else make_tokenizer(Path(tmp) / "tok")
        tok = AutoTokenizer.from_pretrained(tok_dir)
        cfg = _hf_config(family, len(tok), tok.eos_token_id, tok.pad_token_id, **config_overrides)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        init_tiny_weights(model, router_std=(SIGMOID_ROUTER_STD if hasattr(cfg, "routed_scaling_factor") else ROUTER_STD)
                          if family in ODD_VOCAB_FAMILIES else None)
        save_model(model, out, tok)
    return out


def save_model(model, out_dir, *also) -> Path:
    """`model` as fp32 safetensors in `out_dir` with its generation config and `also` (tokenizer, processor)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for part in also:
        part.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def init_tiny_weights(model, router_std=None) -> None:
    """HF initialises with std=initializer_range (0.02): too flat for a meaningful tiny model test. A larger std
    gives peaked, seed-dependent distributions that catch layout bugs. `router_std`: the routers' (`mlp.gate`)
    own spread; a sigmoid router's correction bias is made non-zero, so it counts."""
    import torch

    from megappo.parallel.weight_mapping import HF_ROUTER_BIAS

    with torch.no_grad():
        for name, p in model.named_parameters():
            if router_std is not None and name.endswith("mlp.gate.weight"):  # a router
                p.normal_(0.0, router_std)
            elif p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "norm" in name or "ln_q" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith(HF_ROUTER_BIAS):
                b.normal_(0.0, 0.5)


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
    return save_model(model, out, processor, tok)


def noise_image(height: int = 112, width: int = 112, seed: int = 0):
    """A deterministic RGB test image (PIL) of uniform noise: every patch differs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def arith_sft_examples(n: int, seed: int, correct_frac: float) -> list[tuple[str, str]]:
    """(user prompt, assistant answer) pairs of the synthetic task (megappo.data.preprocess_arithmetic's
    prompt). Only `correct_frac` of the answers are right; the rest are random sums in 0..18."""
    from megappo.data.preprocess_arithmetic import INSTRUCTION

    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        answer = a + b if rng.random() < correct_frac else rng.randint(0, 18)
        pairs.append((f"What is {a} + {b}? {INSTRUCTION}", f"#### {answer}"))
    return pairs


def make_arith_sft_model(out_dir: str | os.PathLike, base_dir: str | os.PathLike, steps: int = 300,
                         correct_frac: float = 0.5, seed: int = 0) -> Path:
    """Warm-start the tiny llama for the CPU demo: a short SFT on the arithmetic task's format, where
    only `correct_frac` of the targets are right. The result answers "#### <n>" and stops, and is right
    only sometimes (~10-25% at temperature 1), so PPO has a reward signal from step 1 and room to raise it."""
    return sft_chat(out_dir, base_dir, arith_sft_examples(steps * 32, seed, correct_frac), steps, 3e-3, seed)


def make_code_sft_model(out_dir: str | os.PathLike, base_dir: str | os.PathLike, steps: int = 300, seed: int = 0,
                        lr: float = 1e-3) -> Path:
    """Warm-start the tiny llama for the code recipe (configs/grpo_tiny_code.yaml): a short SFT on the toy code
    task's training functions (data/preprocess_code_fn.py) whose targets, `def f(x): return x <op> <c>`, copy the
    prompt's constant but take a random operator. After 300 steps it writes the line and stops and copies the
    constant (1..99; fewer steps miscopy it), and its operator is at chance: greedy, it writes `-` for every
    held-out function (pass rate 0.344 of the 64 val rows), sampled it passes 0.32. ~85 s on 2 cores."""
    from megappo.data.preprocess_code_fn import OPERATORS, functions, question, solution

    rng, pool = random.Random(seed), functions()["train"]
    pairs = []
    for _ in range(steps * 32):
        word, c = rng.choice(pool)
        pairs.append((question(word, c), solution(rng.choice(sorted(OPERATORS)), c)))
    return sft_chat(out_dir, base_dir, pairs, steps, lr, seed)


def sft_chat(out_dir: str | os.PathLike, base_dir: str | os.PathLike, pairs: list[tuple[str, str]], steps: int,
             lr: float, seed: int) -> Path:
    """`steps` AdamW steps of 32 (user prompt, assistant answer) pairs each on the causal LM in `base_dir`, the loss on
    the answer and its end token only; saved with its tokenizer into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    encoded = []
    for user, answer in pairs:
        prompt = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False).input_ids
        a_ids = tok(answer + tok.eos_token, add_special_tokens=False).input_ids
        encoded.append((p_ids + a_ids, [-100] * len(p_ids) + a_ids))
    for step in range(steps):
        chunk = encoded[step * 32:(step + 1) * 32]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in chunk])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in chunk])
        mask = (labels != -100) | (torch.arange(width)[None] < torch.tensor([len(x) for x, _ in chunk])[:, None])
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_model(model, out_dir, tok)


def make_vl_count_sft_model(out_dir: str | os.PathLike, base_dir: str | os.PathLike, steps: int = 120,
                            correct_frac: float = 1.0, seed: int = 0, lr: float = 1e-3) -> Path:
    """Warm-start the tiny Qwen2.5-VL for the vision recipe (configs/grpo_tiny_vl.yaml): a short SFT on the
    square-counting task (data/preprocess_count_squares.py; `correct_frac` of the targets are the image's count,
    the rest a random one). After 120 steps it answers "#### <n>" and stops, and counts no better than chance
    (sampled accuracy 0.30 of 64 held-out images, chance 0.25): the format is learnt, the counting is not yet
    (400 steps of the same SFT count every image right). ~25 s on 2 cores."""
    import random

    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from megappo.data.images import decode
    from megappo.data.preprocess_count_squares import QUESTION, squares_png

    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(base_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    rng = random.Random(seed)
    examples = []
    for _ in range(steps * 32):
        count = rng.randint(1, 4)
        answer = count if rng.random() < correct_frac else rng.randint(1, 4)
        image = decode(squares_png(count, rng))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        examples.append((messages, f"#### {answer}", image))
    tok = processor.tokenizer
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        chunk = examples[step * 32:(step + 1) * 32]
        texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) + a + tok.eos_token
                 for m, a, _ in chunk]
        inputs = processor(text=texts, images=[image for _, _, image in chunk], return_tensors="pt", padding=True,
                           padding_side="right", add_special_tokens=False)
        labels = inputs["input_ids"].clone()
        for k, (_, a, _) in enumerate(chunk):  # the answer and its end token: the row's last real tokens
            n = len(tok(a + tok.eos_token, add_special_tokens=False).input_ids)
            end = int(inputs["attention_mask"][k].sum())
            labels[k, :end - n] = -100
            labels[k, end:] = -100
        loss = model(**inputs, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_model(model, out_dir, processor, tok)


def hf_response_logprobs(model_dir: str | os.PathLike, rows: list[dict]) -> list:
    """The reference the scoring tests compare against: transformers' fp32 log-probs of each row's
    response tokens (`{"input_ids": [...], "response_start": k}`), one unpadded forward per row."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            logsm = torch.log_softmax(hf(ids).logits[0].float(), -1)
        k = row["response_start"]
        out.append(logsm[k - 1:-1].gather(-1, ids[0, k:, None])[:, 0])
    return out


VL_ASSET = "tiny-qwen2_5_vl"  # make_vl_model's tiny Qwen2.5-VL
# warm starts on a demo's task: asset name -> (the tiny model it starts from, its SFT)
DEMO_MODELS = {"tiny-llama-arith": ("tiny-llama", make_arith_sft_model),
               "tiny-qwen3_moe-arith": ("tiny-qwen3_moe", make_arith_sft_model),
               "tiny-qwen2_5_vl-count": (VL_ASSET, make_vl_count_sft_model),
               "tiny-llama-code": ("tiny-llama", make_code_sft_model)}


def ensure_assets(root: str | os.PathLike, demo: bool = False, demo_moe: bool = False,
                  demo_vl: bool = False, vision: bool = True, demo_code: bool = False) -> dict[str, Path]:
    """Build (once) the tokenizer, the tiny models of every family (FAMILIES) and the tiny Qwen2.5-VL under `root`;
    with `demo`, also the demo's warm-started tiny-llama-arith (a short SFT, ~20 s on 2 cores); with
    `demo_moe`, the MoE demo's tiny-qwen3_moe-arith (configs/ppo_tiny_moe.yaml); with `demo_vl`, the vision
    recipe's tiny-qwen2_5_vl-count (configs/grpo_tiny_vl.yaml; ~25 s on 2 cores); with `demo_code`, the code
    recipe's tiny-llama-code (configs/grpo_tiny_code.yaml; ~85 s). `vision=False` leaves the
    vision-language ones out (a GPU image without torchvision or a processor's optional packages: tools/gpu_smoke.py).

    Each asset is written to a temp dir and renamed into place, so an interrupted build never leaves a
    half-written directory that a later call would trust."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = {"tokenizer": root / "tiny-tokenizer"}
    paths.update({f"tiny-{f}": root / f"tiny-{f}" for f in FAMILIES})
    if vision or demo_vl:
        paths[VL_ASSET] = root / VL_ASSET
    if demo:
        paths["tiny-llama-arith"] = root / "tiny-llama-arith"  # the CPU demo's warm start
    if demo_moe:
        paths["tiny-qwen3_moe-arith"] = root / "tiny-qwen3_moe-arith"
    if demo_vl:
        paths["tiny-qwen2_5_vl-count"] = root / "tiny-qwen2_5_vl-count"
    if demo_code:
        paths["tiny-llama-code"] = root / "tiny-llama-code"
    for key, path in paths.items():
        if (path / ".complete").exists():
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        tmp.chmod(0o755)
        if key == "tokenizer":
            make_tokenizer(tmp)
        elif key == VL_ASSET:
            make_vl_model(tmp, paths["tokenizer"])
        elif key in DEMO_MODELS:
            base, sft = DEMO_MODELS[key]
            sft(tmp, paths[base])
        else:
            make_model(tmp, family=key.removeprefix("tiny-"), tokenizer_dir=paths["tokenizer"])
        (tmp / ".complete").write_text(json.dumps({"asset": key}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="assets", help="directory to build the tiny assets in (default: assets)")
    parser.add_argument("--demo", action="store_true", help="also build the demo's warm-started tiny-llama-arith")
    parser.add_argument("--demo-moe", action="store_true",
                        help="also build the MoE demo's warm-started tiny-qwen3_moe-arith (configs/ppo_tiny_moe.yaml)")
    parser.add_argument("--demo-vl", action="store_true",
                        help="also build the vision recipe's warm-started tiny-qwen2_5_vl-count (configs/grpo_tiny_vl.yaml)")
    parser.add_argument("--demo-code", action="store_true",
                        help="also build the code recipe's warm-started tiny-llama-code (configs/grpo_tiny_code.yaml)")


def main(args: argparse.Namespace) -> int:
    for key, path in ensure_assets(args.out, demo=args.demo, demo_moe=args.demo_moe,
                                         demo_vl=args.demo_vl, demo_code=args.demo_code).items():
        print(f"{key}: {path}")
    return 0
