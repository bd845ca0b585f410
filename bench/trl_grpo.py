"""TRL's GRPOTrainer on a megappo step shape, for bench/trl_compare.py. Runs in its own venv
(`make trl-venv`: .venv-trl with trl + CPU torch), never in megappo's: it imports neither megappo nor
megatron. The only thing it takes from the project is the task's scorer, loaded by file path
(megappo/rewards/arithmetic.py is plain python), so both sides score a response the same way.

    .venv-trl/bin/python bench/trl_grpo.py SHAPE.json OUT_DIR

SHAPE.json (written by bench/trl_compare.py from a megappo config): model, tokenizer, train/val
parquet, steps, prompts_per_step, n, max_new_tokens, temperature, lr, mini_batch, epochs, kl_coef,
clip, non_stop_penalty (null or the value), bf16 (TRL's bf16=True: autocast over fp32 params), seed.
Writes OUT_DIR/result.json: the training time and the greedy accuracy on the validation prompts after
training (HF generate, the same scorer).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_common import greedy_accuracy, load_scorer, rows  # noqa: E402


def text_of(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def main(shape_path: str, out_dir: str) -> int:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    s = json.loads(Path(shape_path).read_text())
    out = Path(out_dir)
    torch.manual_seed(s["seed"])
    score = load_scorer()
    tok = AutoTokenizer.from_pretrained(s["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    eos = {tok.eos_token_id, tok.pad_token_id} - {None}

    def reward(prompts, completions, completion_ids, ground_truth, **_):
        out = []
        for c, ids, gt in zip(completions, completion_ids, ground_truth):
            r = score(text_of(c), gt)
            if s["non_stop_penalty"] is not None and (not ids or ids[-1] not in eos):
                r = s["non_stop_penalty"]
            out.append(float(r))
        return out

    per_gen = s["prompts_per_step"] * s["n"]
    updates_per_step = (per_gen // s["mini_batch"]) * s["epochs"]
    cfg = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=s["bf16"], report_to="none", save_strategy="no",
        logging_steps=updates_per_step, seed=s["seed"], disable_dropout=True,
        max_steps=s["steps"] * updates_per_step, learning_rate=s["lr"], lr_scheduler_type="constant",
        num_generations=s["n"], per_device_train_batch_size=s["mini_batch"],
        # a generation of per_gen completions = steps_per_generation mini-batches, each reused num_iterations times
        gradient_accumulation_steps=1, steps_per_generation=per_gen // s["mini_batch"],
        num_iterations=s["epochs"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"],
        beta=s["kl_coef"], epsilon=s["clip"], loss_type="dapo", scale_rewards="group")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_list(rows(s["train_file"])))
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0

    val = rows(s["val_file"])
    accuracy = greedy_accuracy(trainer.model, tok, val, s["max_new_tokens"], score, s["bf16"])
    result = {"train_s": round(train_s, 1), "bf16": s["bf16"], "optimizer_steps": trainer.state.global_step,
              "final_eval_accuracy": round(accuracy, 4), "val_prompts": len(val),
              "trl": __import__("trl").__version__}
    (out / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
