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


def test_sigmoid_routers_have_no_near_ties(tiny_assets):
    """The tiny GLM-4.5 / DeepSeek-V3 routers choose with room to spare on the parity tests' tokens: the k-th
    and (k+1)-th biased scores, and the best and second group scores, differ by far more than fp32 noise
    between layouts (1e-6). A saturated sigmoid (router std 0.5) tied DeepSeek's groups to 2.4e-7 and flipped
    one token's experts at TP2 x EP2."""
    import torch
    from transformers import AutoModelForCausalLM

    for fam in ("tiny-glm4_moe", "tiny-deepseek_v3", "tiny-deepseek_v3_lite"):
        model = AutoModelForCausalLM.from_pretrained(tiny_assets[fam], dtype=torch.float32).eval()
        cfg, gaps = model.config, []

        def hook(mod, args, out):
            h = args[0].reshape(-1, args[0].shape[-1])
            biased = torch.sigmoid(torch.nn.functional.linear(h.float(), mod.weight.float())) + mod.e_score_correction_bias
            top = biased.sort(-1, descending=True).values
            gaps.append((top[:, cfg.num_experts_per_tok - 1] - top[:, cfg.num_experts_per_tok]).min().item())
            if cfg.n_group > 1:
                groups = biased.view(biased.shape[0], cfg.n_group, -1).topk(2, -1).values.sum(-1).sort(-1, descending=True).values
                gaps.append((groups[:, cfg.topk_group - 1] - groups[:, cfg.topk_group]).min().item())

        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.register_forward_hook(hook)
        with torch.no_grad():
            model(torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0)))
        assert gaps and min(gaps) > 1e-4, (fam, min(gaps))
