"""TRL's PPOTrainer on a megappo PPO step shape, for bench/trl_compare.py. TRL 1.x has no PPOTrainer,
so this runs trl 0.29's (trl.experimental.ppo), installed without deps next to the TRL venv's trl 1.13
(`make trl-venv`: .venv-trl/trl-0.29) on the venv's torch / transformers / accelerate / datasets:

    PYTHONPATH=.venv-trl/trl-0.29 .venv-trl/bin/python bench/trl_ppo.py SHAPE.json OUT_DIR

SHAPE.json (written by bench/trl_compare.py from a megappo config): trl_grpo.py's fields plus critic_lr,
cliprange_value, gamma, lam, kl_estimator, adam (beta1, beta2, eps), weight_decay; kl_coef is the
penalty in the reward (algorithm.kl_ctrl.kl_coef). Writes OUT_DIR/result.json: the training time,
the median time of a PPO step, the first/last 5 steps' mean score and the greedy accuracy on the
validation prompts after training (HF generate, the same scorer, bench/trl_common.py).

How the megappo step maps onto PPOConfig (one PPO "batch" = one megappo step):
  per_device_train_batch_size = local_rollout_forward_batch_size = prompts x n (one rollout, one
    generate call); gradient_accumulation_steps = 1 and num_mini_batches = prompts x n / mini_batch,
    so each mini-batch is one micro-batch and one optimizer step: mini-batches x epochs optimizer
    steps per step, as megappo's actor does. total_episodes = steps x prompts x n.
  n samples per prompt: TRL PPO has none; its dataloader is replaced by one that draws `prompts`
    prompts per step (shuffled, seeded) and repeats each n times.
  reward: TRL scores with a reward *model* through the module-level get_reward(); the one in
    trl.experimental.ppo.ppo_trainer is wrapped so that for the RuleReward "model" passed as
    reward_model the score is the arithmetic scorer's on the decoded response vs the prompt's
    ground truth, replaced by the non-stop penalty (as megappo's RewardManager does) when the response
    has no eos; the value model still goes through TRL's get_reward. missing_eos_penalty stays None:
    TRL's subtracts, megappo's replaces.
  value model: AutoModelForSequenceClassification(num_labels=1) from the policy's weights (TRL's
    examples); TRL adds vf_coef (its default 0.1) x the value loss to the policy loss and steps one
    optimizer: passed in with two param groups (actor lr, critic lr), constant, AdamW with the
    actor's betas / eps / weight decay.
  kl_coef, kl_estimator (k1), gamma, lam, cliprange (actor.clip_ratio), cliprange_value, temperature,
    response_length (max_new_tokens), stop_token "eos", whiten_rewards False (TRL whitens the
    advantages, as megappo's whiten_advantages does).
Not matched: TRL updates the value model in every (epoch, mini-batch) of the policy (megappo's critic
has its own ppo_epochs / mini-batch size); TRL clips no gradient norm (megappo: clip_grad 1.0) and has no
dual clip (actor.clip_ratio_c); TRL puts the score on the token after the eos (megappo: on the eos).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_common import greedy_accuracy, load_scorer, rows  # noqa: E402


class RuleReward(torch.nn.Module):
    """The task's rule as TRL's reward "model": `forward(query_responses, pad_id, context_length)` ->
    one score per row. The ground truth is looked up by the prompt's token ids (left padding removed)."""

    def __init__(self, tok, score, truth: dict[tuple, str], non_stop_penalty: float | None):
        super().__init__()
        self.tok, self.score, self.truth, self.penalty = tok, score, truth, non_stop_penalty
        self.eos = tok.eos_token_id

    def forward(self, query_responses: torch.Tensor, pad_id: int, context_length: int) -> torch.Tensor:
        out = []
        for row in query_responses.tolist():
            prompt = tuple(t for t in row[:context_length] if t != pad_id)
            response = row[context_length:]
            if pad_id in response:  # TRL pads after the (kept) stop token
                response = response[:response.index(pad_id)]
            r = float(self.score(self.tok.decode(response, skip_special_tokens=True), self.truth[prompt]))
            if self.penalty is not None and self.eos not in response:
                r = self.penalty
            out.append(r)
        return torch.tensor(out, dtype=torch.float32, device=query_responses.device)


def use_rule_reward(ppo_trainer_module) -> None:
    """Route TRL's reward-model call to RuleReward; every other model (the value model) is unchanged."""
    original = ppo_trainer_module.get_reward

    def get_reward(model, query_responses, pad_token_id, context_length):
        if isinstance(model, RuleReward):
            return None, model(query_responses, pad_token_id, context_length), None
        return original(model, query_responses, pad_token_id, context_length)

    ppo_trainer_module.get_reward = get_reward


def main(shape_path: str, out_dir: str) -> int:
    import trl
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
        set_seed,
    )

    if not trl.__version__.startswith("0.29."):
        raise SystemExit(f"trl {trl.__version__} at {trl.__file__}: run with PYTHONPATH=.venv-trl/trl-0.29 "
                         "(`make trl-venv`); TRL 1.x has no PPOTrainer")
    from datasets import Dataset
    from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

    s = json.loads(Path(shape_path).read_text())
    out = Path(out_dir)
    set_seed(s["seed"])  # python, numpy (TRL's mini-batch permutation), torch (the value head's init)
    score = load_scorer()
    tok = AutoTokenizer.from_pretrained(s["tokenizer"])
    tok.padding_side = "left"
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        raise SystemExit("TRL's PPOTrainer takes pad tokens for padding (masked out, cut responses): "
                         "the tokenizer needs a pad token other than its eos")

    train = rows(s["train_file"])
    prompts = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in train]
    truth: dict[tuple, str] = {}
    for ids, r in zip(prompts, train, strict=True):
        if truth.setdefault(tuple(ids), r["ground_truth"]) != r["ground_truth"]:
            raise SystemExit(f"one prompt, two ground truths: {r['prompt']}")

    policy = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(s["model"], dtype=torch.float32, num_labels=1)
    beta1, beta2, eps = s["adam"]
    optimizer = torch.optim.AdamW([{"params": list(policy.parameters()), "lr": s["lr"]},
                                   {"params": list(value.parameters()), "lr": s["critic_lr"]}],
                                  betas=(beta1, beta2), eps=eps, weight_decay=s["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    per_step = s["prompts_per_step"] * s["n"]
    if per_step % s["mini_batch"]:
        raise SystemExit(f"prompts x n = {per_step} is not a multiple of the mini-batch {s['mini_batch']}")
    cfg = PPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=s["bf16"], report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=s["seed"], gradient_checkpointing=False,
        per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=per_step, num_mini_batches=per_step // s["mini_batch"],
        num_ppo_epochs=s["epochs"], total_episodes=s["steps"] * per_step, num_sample_generations=0,
        response_length=s["max_new_tokens"], temperature=s["temperature"], stop_token="eos",
        missing_eos_penalty=None, learning_rate=s["lr"], lr_scheduler_type="constant",
        kl_coef=s["kl_coef"], kl_estimator=s["kl_estimator"], cliprange=s["clip"],
        cliprange_value=s["cliprange_value"], gamma=s["gamma"], lam=s["lam"], whiten_rewards=False)

    class StepLog(TrainerCallback):
        def __init__(self):
            self.t, self.step_s, self.scores = 0.0, [], []

        def on_train_begin(self, *_, **__):
            self.t = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "objective/scores" in logs:
                self.scores.append(logs["objective/scores"])

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            self.step_s.append(now - self.t)
            self.t = now

    use_rule_reward(ppo_trainer)
    steps = StepLog()
    trainer = PPOTrainer(
        args=cfg, processing_class=tok, model=policy, ref_model=None,  # ref: TRL's frozen copy of the policy
        reward_model=RuleReward(tok, score, truth, s["non_stop_penalty"]), value_model=value,
        train_dataset=Dataset.from_dict({"input_ids": prompts}), optimizers=(optimizer, scheduler),
        callbacks=[steps])

    def n_each(batch: list[int]) -> dict:  # `prompts_per_step` prompts -> each n times, left-padded
        ids = [prompts[i] for i in batch for _ in range(s["n"])]
        width = max(map(len, ids))
        return {"input_ids": torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])}

    trainer.dataloader = trainer.accelerator.prepare(DataLoader(
        range(len(prompts)), batch_size=s["prompts_per_step"], shuffle=True, drop_last=True, collate_fn=n_each,
        generator=torch.Generator().manual_seed(s["seed"])))

    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0

    val = rows(s["val_file"])
    model = trainer.accelerator.unwrap_model(trainer.model).policy
    accuracy = greedy_accuracy(model, tok, val, s["max_new_tokens"], score, s["bf16"])
    mean5 = lambda xs: round(statistics.mean(xs), 3) if xs else None  # noqa: E731
    result = {"train_s": round(train_s, 1), "steps": trainer.state.global_step,
              "optimizer_steps": trainer.state.global_step * cfg.num_mini_batches * cfg.num_ppo_epochs,
              "step_median_s": round(statistics.median(steps.step_s), 3) if steps.step_s else None,
              "first5_scores": mean5(steps.scores[:5]), "last5_scores": mean5(steps.scores[-5:]),
              "final_eval_accuracy": round(accuracy, 4), "val_prompts": len(val), "bf16": s["bf16"],
              "trl": trl.__version__}
    (out / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
