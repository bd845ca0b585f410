"""The config.json keys vLLM 0.32's model loaders read otherwise than transformers, whose model megappo trains
(megatron reads a config through parallel/model_dims.py as transformers does) and checks against:
`vllm_config_fixes(raw)` gives the keys to write so that vLLM builds transformers' model, and one line saying so.
The rollout engine passes them to vLLM as `hf_overrides` (printing the line); the converter writes them into an
exported config.json, which `vllm.LLM(DIR)` loads without megappo. No torch, no vLLM import.

- deepseek_v3 without `topk_method` / `scoring_func` (DeepseekV3Config has neither): transformers always routes
  by the sigmoid scores plus `e_score_correction_bias` (noaux_tc); vLLM's deepseek_v2.py reads them, defaulting to
  softmax and no bias parameter (then fails on the checkpoint's e_score_correction_bias: KeyError). A config
  naming another router is refused by model_dims instead.
- deepseek_v3 `moe_layer_freq` other than 1: transformers ignores it (experts on every layer from
  first_k_dense_replace on), vLLM's keeps experts only on layers i % moe_layer_freq == 0.
- glm4_moe without `head_dim` (Glm4MoeConfig has no default): transformers' attention takes hidden_size /
  num_attention_heads, vLLM's glm4_moe.py reads config.head_dim (AttributeError).
"""

from __future__ import annotations

from megappo.parallel.model_dims import DEEPSEEK_V3_ROUTER


def vllm_config_fixes(raw: dict) -> tuple[dict, str]:
    """({config.json key: the value transformers computes with}, one line naming them) for a config.json read as a
    dict; ({}, "") when vLLM reads it as transformers does."""
    mt = raw.get("model_type")
    fixes, why = {}, []
    if mt == "deepseek_v3":
        router = {k: v for k, v in DEEPSEEK_V3_ROUTER.items() if raw.get(k) is None}
        if router:
            fixes.update(router)
            why.append(f"{' and '.join(router)} absent: transformers' DeepseekV3 always routes so")
        if int(raw.get("moe_layer_freq", 1) or 1) != 1:
            fixes["moe_layer_freq"] = 1
            why.append(f"moe_layer_freq {raw['moe_layer_freq']}: transformers ignores it")
    if mt == "glm4_moe" and raw.get("head_dim") is None:
        fixes["head_dim"] = int(raw["hidden_size"]) // int(raw["num_attention_heads"])
        why.append("head_dim absent: transformers' hidden_size / num_attention_heads")
    if not fixes:
        return {}, ""
    said = ", ".join(f"{k}={v!r}" for k, v in fixes.items())
    return fixes, f"{mt} config.json read as transformers reads it, for vLLM: {said} ({'; '.join(why)})"
