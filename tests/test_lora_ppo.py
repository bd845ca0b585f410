"""LoRA in the PPO engine (actor.lora, #40 slice 2): the config refused in one line before any worker
starts; the actor engine with adapters (base frozen: no grad buffer, no optimizer state); the reference
as the base with adapters off."""

from pathlib import Path

import pytest

from megappo.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "ppo_tiny.yaml"

LORA_INVALID = [
    (["actor.lora.rank=-1"], "actor.lora.rank=-1 must be >= 0"),
    (["actor.lora.rank=4", "actor.lora.alpha=0"], "actor.lora.alpha=0.0 must be > 0"),
    (["actor.lora.rank=4", "actor.lora.dropout=1.0"], "actor.lora.dropout=1.0 must be in [0, 1)"),
    (["actor.lora.rank=4", "actor.lora.target_modules=[q_proj]"], "linear_qkv, linear_fc1, linear_proj, linear_fc2"),
    (["actor.lora.rank=4", "actor.lora.init=xavier"], "choose one of: kaiming, gaussian"),
]


@pytest.mark.parametrize("overrides,expected", LORA_INVALID, ids=[" ".join(o) for o, _ in LORA_INVALID])
def test_bad_lora_config_is_one_line(overrides, expected):
    load_config(TINY, ["actor.lora.rank=4"])  # a valid LoRA config
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_lora_on_a_moe_model_is_refused_in_one_line(tiny_assets):
    moe = [f"model.path={tiny_assets['tiny-qwen3_moe']}"]
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/ppo_tiny_moe.yaml", moe + ["actor.lora.rank=4"])
    assert "routed experts are not adapted yet" in str(info.value) and "\n" not in str(info.value)
