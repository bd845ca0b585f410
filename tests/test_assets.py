"""The tiny assets load offline with the Auto* classes, are deterministic, and have the shapes the
rest of the suite relies on (head_dim 32 for vLLM CPU, vocab not a multiple of 128)."""

import hashlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from megappo.assets import make_tokenizer


def test_tokenizer_offline_left_padded_with_chat_template(tiny_assets):
    tok = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    assert tok.padding_side == "left"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    assert len(tok) % 128 != 0
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("What is 12 + 35? The answer is 47.").input_ids
    assert tok.decode(ids) == "What is 12 + 35? The answer is 47."
    batch = tok(["a", "What is 1 + 1?"], padding=True, return_tensors="pt")
    assert batch.input_ids[0, 0].item() == tok.pad_token_id  # left padding


def test_tokenizer_is_deterministic(tmp_path, tiny_assets):
    make_tokenizer(tmp_path / "again")
    a = (tiny_assets["tokenizer"] / "tokenizer.json").read_bytes()
    b = (tmp_path / "again" / "tokenizer.json").read_bytes()
    assert hashlib.sha256(a).hexdigest() == hashlib.sha256(b).hexdigest()


def test_tiny_models_load_and_run(tiny_assets):
    tok = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    for family, tied in (("llama", False), ("qwen2", True), ("mistral", False), ("qwen3", True)):
        path = tiny_assets[f"tiny-{family}"]
        cfg = AutoConfig.from_pretrained(path)
        assert cfg.model_type == family
        assert cfg.hidden_size // cfg.num_attention_heads == 32
        assert getattr(cfg, "head_dim", 32) == (64 if family == "qwen3" else 32)
        assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
        assert cfg.vocab_size == len(tok) and cfg.vocab_size % 128 != 0
        assert cfg.tie_word_embeddings == tied
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if family == "qwen2":
            assert model.model.layers[0].self_attn.q_proj.bias is not None
        if family == "qwen3":
            assert model.model.layers[0].self_attn.q_norm.weight.shape == (64,)
        out = model(torch.tensor([[1, 2, 3, 4]])).logits
        assert out.shape == (1, 4, cfg.vocab_size) and torch.isfinite(out).all()
        # peaked enough that layout bugs show: the top token is far from uniform
        assert out.softmax(-1).max() > 5.0 / cfg.vocab_size
