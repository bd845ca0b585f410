"""Checks the vLLM-engine tests share."""

from __future__ import annotations


def greedy_gap_to_hf(rollout, hf_dir, texts: list[str], max_new_tokens: int = 8) -> float:
    """Greedy responses of a VLLMRollout to `texts`, and the largest |vLLM - transformers| log-prob over their
    sampled tokens, transformers computing fp32 on the same weights (`hf_dir`) at the rollout's positions."""
    import torch
    from transformers import AutoModelForCausalLM

    from megappo.protocol import DataProto
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import left_pad

    tok = rollout.tokenizer
    prompts = DataProto.from_dict(left_pad([tok(t, add_special_tokens=False)["input_ids"] for t in texts],
                                           tok.pad_token_id), {"uid": [str(i) for i in range(len(texts))]})
    gen = rollout.generate_sequences(DataProto(prompts.batch, prompts.non_tensor_batch,
                                               {"sampling": SamplingSpec(max_new_tokens=max_new_tokens).greedy()}))
    b, R = gen.batch, gen.batch["responses"].shape[1]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                    position_ids=b["position_ids"]).logits[:, -R - 1:-1]
    lp = torch.log_softmax(logits, -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    return (lp - b["rollout_log_probs"]).abs()[b["response_mask"].bool()].max().item()
