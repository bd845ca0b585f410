"""What bench/trl_grpo.py and bench/trl_ppo.py share: the task's scorer, the parquet rows and the final
greedy accuracy on the validation prompts. Runs in the TRL venv (`make trl-venv`): imports neither
megappo nor megatron, nor trl (the two scripts run on different TRL versions)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_scorer():
    """megappo/rewards/arithmetic.py's compute_score, loaded by file path (it is plain python), so both
    sides score a response the same way."""
    spec = importlib.util.spec_from_file_location("arith_scorer", REPO / "megappo/rewards/arithmetic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.compute_score


def rows(path: str) -> list[dict]:
    """The parquet's rows as {"prompt": chat messages, "ground_truth": str}."""
    import pyarrow.parquet as pq

    return [{"prompt": list(r["prompt"]), "ground_truth": str(r["reward_model"]["ground_truth"])}
            for r in pq.read_table(path).to_pylist()]


def greedy_accuracy(model, tok, val: list[dict], max_new_tokens: int, score, bf16: bool, batch: int = 64) -> float:
    """Share of the validation prompts whose greedy response (HF generate, chat template, left padding)
    gets the full score (>= 1.0), as megappo's eval/verifiable_correct_rate counts it. bf16: under bf16
    autocast, as the run trained (megappo evaluates a bf16 run in bf16 vLLM)."""
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return _greedy_accuracy(model, tok, val, max_new_tokens, score, batch)


def _greedy_accuracy(model, tok, val, max_new_tokens, score, batch) -> float:
    import torch

    model = model.eval()
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    correct = 0
    with torch.no_grad():
        for i in range(0, len(val), batch):
            chunk = val[i:i + batch]
            texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            for r, ids in zip(chunk, gen[:, enc["input_ids"].shape[1]:]):
                correct += score(tok.decode(ids, skip_special_tokens=True), r["ground_truth"]) >= 1.0
    return correct / len(val)
