"""One test per CPU shim of parallel/cpu_compat.py. The shims are process-wide, so they run in a
spawned process (never in the pytest process)."""

import pytest
import torch

from megappo.parallel.launch import spawn_local


def _checks(rank, world, port):
    import torch.distributed as dist

    from megappo.parallel import cpu_compat
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron

    out = {}
    assert cpu_compat.apply() is True and cpu_compat.apply() is True  # idempotent
    # shim 1: cuda placements land on the CPU; Tensor.type() answers the CUDA name
    out["zeros_device"] = str(torch.zeros(2, device="cuda").device)
    out["tensor_device"] = str(torch.tensor([1.0], device=torch.device("cuda")).device)
    out["to_cuda"] = str(torch.ones(1).to("cuda").device) + "," + str(torch.ones(1).cuda().device)
    out["pinned"] = torch.tensor([1, 2], device="cpu", pin_memory=True).cuda(non_blocking=True).tolist()
    out["type"] = torch.ones(1).type()
    out["type_bf16"] = torch.ones(1, dtype=torch.bfloat16).type()
    out["type_cast"] = torch.ones(1).type(torch.float64).dtype == torch.float64
    # suspended(): the block runs without the mode (vLLM generation), and the mode comes back after
    with cpu_compat.suspended():
        out["suspended_type"] = torch.ones(1).type()
        with cpu_compat.suspended():  # nested: nothing left to pop
            out["nested_type"] = torch.ones(1).type()
    out["resumed_type"] = torch.ones(1).type()
    # shim 2: current_device / synchronize
    out["current_device"] = torch.cuda.current_device()
    out["sync"] = torch.cuda.synchronize() is None
    # megatron code paths that hard-code cuda
    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(ParallelLayout(), seed=7)
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import random as mrandom

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    out["grad_norm"] = get_grad_norm_fp32([p.grad])
    # shim 3: RNG tracker on the CPU generator, forks are reproducible and restore the caller's state
    tracker = mrandom.get_cuda_rng_tracker()
    out["tracker"] = type(tracker).__name__
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    out["restored"] = torch.equal(before, torch.get_rng_state())
    with tracker.fork():
        b = torch.rand(3)
    out["advances"] = not torch.equal(a, b)
    mrandom.model_parallel_cuda_manual_seed(7, force_reset_rng=False)
    with mrandom.get_cuda_rng_tracker().fork():
        c = torch.rand(3)
    out["reseed_reproducible"] = torch.equal(a, c)
    # activation recompute saves / restores "cuda" RNG state through the patched helpers
    st = mrandom._get_cuda_rng_state()
    x = torch.rand(2)
    mrandom._set_cuda_rng_state(st)
    out["rng_helpers"] = torch.equal(x, torch.rand(2))
    # shim 4: sequence-parallel norm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            sequence_parallel=True, tensor_model_parallel_size=2, use_cpu_initialization=True)
    norm = cpu_compat.SequenceParallelTorchNorm(cfg, 8, eps=1e-6)
    out["sp_norm"] = (type(norm).__name__, all(getattr(q, "sequence_parallel", False) for q in norm.parameters()))
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    try:
        WrappedTorchNorm(cfg, 8)
        out["wrapped_asserts"] = False
    except AssertionError:
        out["wrapped_asserts"] = True
    # shim 8: the aux-loss-free router's token count eager (megatron compiles it with inductor: ~3 s a process)
    from megatron.core.transformer.moe.router import TopKRouter

    compiled = TopKRouter._apply_expert_bias
    cpu_compat.eager_expert_bias()
    out["expert_bias"] = (hasattr(compiled, "_torchdynamo_orig_callable"),
                          TopKRouter._apply_expert_bias is getattr(compiled, "_torchdynamo_orig_callable", None))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is a no-op with a GPU")
    return spawn_local(_checks, 1, timeout=300)[0]


def test_cuda_placements_redirected_to_cpu(results):
    assert results["zeros_device"] == "cpu" and results["tensor_device"] == "cpu"
    assert results["to_cuda"] == "cpu,cpu"
    assert results["pinned"] == [1, 2]  # pinned host memory needs a driver: plain host memory instead


def test_tensor_type_reports_cuda_names(results):
    assert results["type"] == "torch.cuda.FloatTensor"
    assert results["type_bf16"] == "torch.cuda.BFloat16Tensor"
    assert results["type_cast"]


def test_suspended_block_runs_without_the_mode(results):
    assert results["suspended_type"] == results["nested_type"] == "torch.FloatTensor"
    assert results["resumed_type"] == "torch.cuda.FloatTensor"


def test_current_device_and_synchronize(results):
    assert results["current_device"] == "cpu" and results["sync"]
    assert abs(results["grad_norm"] - 4.0) < 1e-6  # megatron clip_grads runs its cuda code path on CPU


def test_rng_tracker_on_cpu_generator(results):
    assert results["tracker"] == "CpuRNGStatesTracker"
    assert results["restored"] and results["advances"] and results["reseed_reproducible"]
    assert results["rng_helpers"]


def test_sequence_parallel_norm(results):
    assert results["sp_norm"] == ("RMSNorm", True)
    assert results["wrapped_asserts"]  # why the shim exists


def test_the_expert_bias_count_runs_eager(results):
    assert results["expert_bias"] == (True, True)  # megatron's is torch.compile'd; ours its plain function


def test_not_applied_in_this_process():
    from megappo.parallel import cpu_compat

    assert not cpu_compat.is_applied()
    with pytest.raises(Exception):
        torch.zeros(1, device="cuda")


def test_causal_mask_masks_the_future_keys():
    """shim 6: the causal mask the engine hands megatron's local attention (True = masked)."""
    from megappo.parallel import cpu_compat

    m = cpu_compat.causal_mask(3, torch.device("cpu"))
    assert m.shape == (1, 1, 3, 3) and m.dtype == torch.bool
    assert m[0, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert cpu_compat.causal_mask(3, torch.device("cpu")) is m  # cached per (length, device)


def test_rng_tracker_nested_forks_go_on_as_megatrons():
    """A fork inside a fork of the same name goes on from the live state and the outer one goes on from where the
    inner left it (megatron's TransformerBlock forks the model-parallel generator under sequence parallelism, and
    LoRA's dropout may fork again inside): one stream, not the same numbers at every block. Another name inside
    leaves the outer stream alone. The default generator is untouched throughout."""
    from megappo.parallel.cpu_compat import CpuRNGStatesTracker

    t = CpuRNGStatesTracker()
    t.add("a", 11)
    t.add("b", 12)
    default = torch.get_rng_state()
    draws = []
    for _ in range(2):  # two "blocks"
        with t.fork("a"):
            draws.append(torch.rand(1))
            with t.fork("a"):
                draws.append(torch.rand(1))
            with t.fork("b"):
                torch.rand(3)
            draws.append(torch.rand(1))
    assert torch.equal(torch.cat(draws), torch.rand(6, generator=torch.Generator().manual_seed(11)))
    assert torch.equal(torch.get_rng_state(), default)
