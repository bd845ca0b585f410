"""Device discipline, checked on a CPU-only machine.

With resources.device=cpu there is no second device to mismatch, so these tests check the discipline
that makes the GPU path right instead of its outcome:
- every tensor megappo's device code creates (engine, role plumbing, scoring, vLLM rollout, hybrid
  engine, weight fingerprints, log-probs) states its device: a factory call (torch.zeros, tensor,
  arange, ...) made from a megappo source line without `device=` would land on the default device (the
  CPU) on a GPU run and meet CUDA tensors there. `ImplicitDeviceAudit` (a TorchFunctionMode) records
  such calls while a real engine trains, scores, reshards into vLLM and generates;
- nothing but CPU tensors crosses the worker boundary (DataProto refuses to be pickled with a device
  tensor; tests/test_protocol.py) and the engine hands back what the driver can read;
- the device is one value, resolved once from resources.device.
What this cannot catch: a tensor created with an explicit but wrong device, device mix-ups inside
third-party code (megatron, vLLM), and anything on a path these runs do not execute (TE, nccl, vLLM
sleep mode): tools/gpu_check.py runs those on a GPU.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megappo.parallel.launch import spawn_local

PKG = str(Path(__file__).resolve().parents[1] / "megappo")
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.rand,
             torch.randn, torch.randint, torch.eye, torch.linspace}


class ImplicitDeviceAudit(TorchFunctionMode):
    """Records (file:line function) of every factory call without `device=` made from megappo's code."""

    def __init__(self):
        super().__init__()
        self.sites: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(PKG):
                self.sites.add(f"{frame.f_code.co_filename[len(PKG) - 7:]}:{frame.f_lineno} {frame.f_code.co_name}")
        return func(*args, **kwargs)


def test_the_audit_sees_an_implicit_device():
    """The audit itself: a megappo-looking frame that calls torch.zeros without a device is recorded."""
    code = compile("def make():\n    return torch.zeros(2)\n", PKG + "/fake_module.py", "exec")
    ns = {"torch": torch}
    exec(code, ns)
    with ImplicitDeviceAudit() as audit:
        ns["make"]()
        torch.zeros(2, device="cpu")  # explicit: fine
    assert audit.sites == {"megappo/fake_module.py:2 make"}, audit.sites


def _device_job(rank, world, port, model_dir):
    import os
    from types import SimpleNamespace

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from megappo.config.schema import RolloutConfig
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.ppo.losses import PolicyLoss, ValueLoss
    from megappo.protocol import DataProto
    from megappo.workers import roles
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig
    from megappo.workers.rollout.hybrid_engine import HybridEngine
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import VLLMRollout, left_pad

    layout = ParallelLayout()
    init_distributed(rank, world, master_port=port)
    init_megatron(layout, seed=3)
    with ImplicitDeviceAudit() as audit:
        actor = MegatronEngine(model_dir, layout, EngineConfig(head="lm", optim=OptimConfig(lr=1e-3)))
        critic = MegatronEngine(model_dir, layout, EngineConfig(head="value", optim=OptimConfig(lr=1e-3)))
        rollout = VLLMRollout(model_dir, RolloutConfig(n=2, max_new_tokens=6, kv_cache_memory_mb=16), seed=0,
                              dtype="float32", max_model_len=128)
        hybrid = HybridEngine(actor, rollout, bucket_mb=1)
        tok = rollout.tokenizer
        prompts = DataProto.from_dict(left_pad([tok(t, add_special_tokens=False)["input_ids"] for t in
                                                ["What is 1 + 2?", "the water is", "one two"]], tok.pad_token_id),
                                      {"uid": ["a", "b", "c"]})
        prompts.meta_info["sampling"] = SamplingSpec(n=2, temperature=0.9, max_new_tokens=6, seed=5)
        with hybrid:
            out = hybrid.generate_sequences(prompts)
        parity = hybrid.logprob_parity(out, micro_batch_size=2)
        old = roles._forward(actor, out, 6, 2, temperature=0.9, compute_entropy=True)
        values = roles._forward(critic, out, 6, 2)
        batch = out.union(DataProto.from_dict({
            "old_log_probs": old["logprobs"], "advantages": torch.randn(len(out), 6, device="cpu"),
            "values": values["values"], "returns": torch.ones(len(out), 6, device="cpu")}))
        role_cfg = SimpleNamespace(ppo_mini_batch_size=6, micro_batch_size=3, ppo_epochs=1)
        am = roles._train(actor, batch, PolicyLoss(entropy_coeff=0.01), role_cfg, 1, temperature=0.9)
        cm = roles._train(critic, batch, ValueLoss(), role_cfg, 1)
    outputs = {"old": old, "values": values, "rollout": {k: v for k, v in out.batch.items()}}
    return {"sites": sorted(audit.sites), "parity": parity, "actor": am, "critic": cm,
            "devices": sorted({str(v.device) for d in outputs.values() for v in d.values()})}


def test_engine_rollout_and_roles_state_every_device(tiny_assets):
    (r,) = spawn_local(_device_job, 1, str(tiny_assets["tiny-llama"]), timeout=600)
    assert r["sites"] == [], "tensors created on the default device:\n  " + "\n  ".join(r["sites"])
    assert r["devices"] == ["cpu"]  # what the driver gets
    assert r["parity"]["rollout/logprob_diff_max"] < 1e-4  # the audited run did real work
    assert r["actor"]["actor/grad_norm"] > 0 and r["critic"]["critic/grad_norm"] > 0


def test_one_device_value_from_the_config(tiny_assets):
    from megappo.config import load_config
    from megappo.parallel.megatron_init import resolve_device
    from megappo.workers.megatron_engine import engine_config_from

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/ppo_tiny.yaml", validate=False)
    assert {engine_config_from(cfg, r).device for r in ("actor", "ref", "critic", "reward_model")} == {"cpu"}
    cfg.resources.device = "auto"
    assert engine_config_from(cfg, "actor").device == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="resources.device=cuda but this process sees no GPU"):
            resolve_device("cuda")
