"""LoRA on a MoE model's routed experts (actor.lora.experts; models/lora.py): tiny Mixtral (4 layers, each
4 routed experts, top-2), fp32, CPU/gloo, megatron's engine (DDP, distributed optimizer), at EP2 x DP2
(each rank holds 2 of the 4 experts of every layer), at TP2 (expert TP 2: each rank holds half of every
expert's fc1 outputs and fc2 inputs; the dispatcher sums the pair's outputs) and in one process (EP1).

- The same adapter (random, B nonzero; attention and every expert's fc1/fc2) gives the
  log-probs of the HF model with each adapted weight merged (W + alpha/r B@A, written here expert by
  expert), <= 1e-4; the adapter exported in peft's layout (stacked expert tensors, target_parameters)
  loads with `peft` and gives them too.
- One optimizer step at EP2 equals the single-process step (<= 1e-5): an expert adapter's gradient is
  averaged over the expert-data-parallel group, as the expert's weight's is, not over every DP rank.
  At TP2 too: the replicated A of fc1 and B of fc2 get the whole gradient on both ranks, and the
  input gradients the dispatcher sums are each rank's part (a factor 2 anywhere fails the check).
- The step leaves every base weight bit-identical; the exported adapter gives the stepped model's
  log-probs in HF + peft; the EP2 checkpoint (adapters + Adam state) resumes in one process, and the
  export CLI's merged HF model from it gives those log-probs too.

Mixtral, not the tiny Qwen3-MoE: that one's layer 0 is a dense MLP, and peft (transformers 5) reads a
dense gate_proj/up_proj/down_proj target on a Qwen3-MoE as the experts' (save_peft_adapter refuses it).
"""

import pytest
import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout

RANK, ALPHA = 4, 8.0
OPTIM = dict(lr=1e-2, adam_eps=1e-4, clip_grad=1.0)  # eps well above fp32 summation noise in the grads
LAYOUTS = {1: ParallelLayout(), 2: ParallelLayout(dp=2, ep=2), "tp2": ParallelLayout(tp=2)}


def random_adapter(path) -> dict:
    """{HF module (per-expert on-disk names, block_sparse_moe.experts.{e}.w1|w3|w2): (A, B)} for every adapted
    projection: test_lora's attention adapters (A shared within q/k/v), and per expert A shared by w1/w3."""
    from transformers import AutoConfig

    from test_lora import random_adapter as attention_and_mlp

    c = AutoConfig.from_pretrained(path)
    h, f = c.hidden_size, c.intermediate_size
    out = {k: v for k, v in attention_and_mlp(path).items() if ".self_attn." in k}
    g = torch.Generator().manual_seed(11)
    for i in range(c.num_hidden_layers):
        for e in range(c.num_local_experts):
            q = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            a_fc = (torch.rand(RANK, h, generator=g) * 2 - 1) / h ** 0.5
            a_down = (torch.rand(RANK, f, generator=g) * 2 - 1) / f ** 0.5
            out[q + "w1"], out[q + "w3"] = (a_fc, torch.randn(f, RANK, generator=g) * 0.1), \
                (a_fc, torch.randn(f, RANK, generator=g) * 0.1)
            out[q + "w2"] = (a_down, torch.randn(h, RANK, generator=g) * 0.1)
    return out


def merged_hf_model(path, adapter):
    """The HF model with every adapted weight merged, expert by expert into transformers' stacked tensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    s = ALPHA / RANK
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            p = f"model.layers.{i}."
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                a, b = adapter[p + "self_attn." + proj]
                getattr(layer.self_attn, proj).weight += s * b @ a
            ex = layer.mlp.experts
            for e in range(ex.gate_up_proj.shape[0]):
                q = p + f"block_sparse_moe.experts.{e}."
                (a, b1), (_, b3) = adapter[q + "w1"], adapter[q + "w3"]
                ex.gate_up_proj[e] += s * torch.cat([b1, b3]) @ a  # [gate (w1); up (w3)] rows, transformers' order
                a, b = adapter[q + "w2"]
                ex.down_proj[e] += s * b @ a
    return model


def _worker(rank, world, port, path, ep, adapter, out_dir):
    from megatron.core import parallel_state as mpu

    from megappo.models.gpt import load_hf_config
    from megappo.models.lora import LoraConfig, iter_lora_modules
    from megappo.models.lora_peft import load_hf_lora
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.parallel.weight_mapping import ModelDims
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig
    from test_megatron_engine import B, R, make_batch, pg_loss

    init_distributed(rank, world, "127.0.0.1", port)
    layout = LAYOUTS[ep]
    cfg = EngineConfig(optim=OptimConfig(**OPTIM), lora=LoraConfig(rank=RANK, alpha=ALPHA, experts=True))
    init_megatron(layout)
    eng = MegatronEngine(path, layout, cfg)
    dims = ModelDims.from_hf_config(load_hf_config(path), tp=layout.tp)
    load_hf_lora(eng.inner_chunks(), adapter, dims, mpu.get_tensor_model_parallel_rank(), layout.tp)
    batch = make_batch()
    dp, n = mpu.get_data_parallel_rank(), B // layout.dp
    local = {k: v[dp * n:(dp + 1) * n] for k, v in batch.items()}
    res = {"dp": dp, "tp": mpu.get_tensor_model_parallel_rank(), "rows": (dp * n, (dp + 1) * n),
           "names": [name for name, _ in iter_lora_modules(eng.inner_chunks())],
           "expert_grad_groups": {p.allreduce for name, m in iter_lora_modules(eng.inner_chunks())
                                  if ".experts." in name for p in (m.lora_A, m.lora_B)}}
    res["lp0"] = eng.forward_only(local, R, 4)["logprobs"]
    base0 = {k: v.detach().clone() for c in eng.inner_chunks() for k, v in c.named_parameters() if "lora_" not in k}
    eng.train_step(local, pg_loss, batch["response_mask"].sum().item(), R, 2)
    res["base_bit_identical"] = all(torch.equal(v, dict(c.named_parameters())[k])
                                    for c in eng.inner_chunks() for k, v in base0.items()
                                    if k in dict(c.named_parameters()))
    res["lp1"] = eng.forward_only(local, R, 4)["logprobs"]
    eng.export_lora_adapter(f"{out_dir}/peft_ep{ep}")
    eng.save_checkpoint(f"{out_dir}/ckpt_ep{ep}")
    eng.finish_save()
    return res


def _resume_worker(rank, world, port, path, ckpt, out):
    from megappo.models.lora import LoraConfig
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(LAYOUTS[1])
    eng = MegatronEngine(path, LAYOUTS[1], EngineConfig(optim=OptimConfig(**OPTIM),
                                                         lora=LoraConfig(rank=RANK, alpha=ALPHA, experts=True)))
    eng.load_checkpoint(ckpt)
    eng.export_lora_adapter(out)
    return eng.steps


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    path = str(tiny_assets["tiny-mixtral"])
    tmp = tmp_path_factory.mktemp("lora_experts")
    adapter = random_adapter(path)
    ep2 = spawn_local(_worker, 2, path, 2, adapter, str(tmp), timeout=600)
    (ep1,) = spawn_local(_worker, 1, path, 1, adapter, str(tmp), timeout=600)
    tp2 = spawn_local(_worker, 2, path, "tp2", adapter, str(tmp), timeout=600)
    return path, tmp, adapter, ep1, ep2, tp2


def _joined(ep2, key):
    return torch.cat([r[key] for r in sorted(ep2, key=lambda r: r["dp"]) if r.get("tp", 0) == 0])


def _hf_logprobs(model):
    """HF's log-probs of make_batch's response tokens, each row alone without its padding, and the mask of
    the rows compared (a row whose response ends in padding is left out)."""
    from test_megatron_engine import R, make_batch

    b = make_batch()
    out, keep = torch.zeros(b["input_ids"].shape[0], R), b["attention_mask"][:, -R:].all(-1, keepdim=True)
    with torch.no_grad():
        for i, (ids, m) in enumerate(zip(b["input_ids"], b["attention_mask"])):
            if keep[i]:
                row = ids[m.bool()][None]
                lp = torch.log_softmax(model(input_ids=row).logits.float(), -1)[0, :-1].gather(-1, row[0, 1:, None])
                out[i] = lp[-R:, 0]
    assert keep.sum() >= 4
    return out, keep.float().expand(-1, R)


def _gap(a, b, mask) -> float:
    return ((a - b).abs() * mask).max().item()


def test_expert_adapters_are_wrapped_and_reduced_over_expert_dp(runs):
    _, _, _, ep1, ep2, tp2 = runs
    experts1 = [n for n in ep1["names"] if ".experts." in n]
    assert len(experts1) == 4 * 4 * 2  # 4 layers x 4 experts x fc1/fc2
    held = [sorted({n.split(".local_experts.")[1].split(".")[0] for n in r["names"] if ".experts." in n})
            for r in sorted(ep2, key=lambda r: r["dp"])]
    assert held == [["0", "1"], ["2", "3"]]  # global expert indices: each rank holds its own 2
    # marked as megatron marks expert weights: reduced over the expert-data-parallel group (DDP's expert buffers)
    assert all(r["expert_grad_groups"] == {False} for r in [ep1, *ep2, *tp2])


def test_logprobs_match_the_merged_hf_model_and_peft(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megappo.models.lora import LoraConfig

    from megappo.models.lora_peft import save_peft_adapter

    path, tmp, adapter, ep1, ep2, tp2 = runs
    ref, mask = _hf_logprobs(merged_hf_model(path, adapter))
    base, _ = _hf_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    save_peft_adapter(adapter, LoraConfig(rank=RANK, alpha=ALPHA, experts=True), path, tmp / "random_peft")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                           str(tmp / "random_peft")).eval()
    via_peft, _ = _hf_logprobs(peft_model)
    gaps = {"ep1": _gap(ep1["lp0"], ref, mask), "ep2": _gap(_joined(ep2, "lp0"), ref, mask),
            "tp2": _gap(_joined(tp2, "lp0"), ref, mask), "peft": _gap(via_peft, ref, mask)}
    print(f"log-probs vs merged HF: {gaps}; the adapter moves them by {_gap(ref, base, mask):.2f}")
    assert _gap(ref, base, mask) > 0.05  # the adapter (experts included) changes the model: the check has teeth
    assert max(gaps.values()) <= 1e-4


def test_one_step_at_ep2_equals_the_single_process_step(runs):
    from safetensors.torch import load_file

    _, tmp, _, ep1, ep2, tp2 = runs
    one, two, tp = (load_file(str(tmp / f"peft_ep{ep}" / "adapter_model.safetensors")) for ep in (1, 2, "tp2"))
    assert one.keys() == two.keys() == tp.keys() and any(".mlp.experts." in k for k in one)
    worst = {name: max((one[k] - other[k]).abs().max().item() for k in one) for name, other in
             (("ep2", two), ("tp2", tp))}
    moved = max((one[k] - load_file(str(tmp / "random_peft" / "adapter_model.safetensors"))[k]).abs().max().item()
                for k in one)
    lp = {"ep2": (ep1["lp1"] - _joined(ep2, "lp1")).abs().max().item(),
          "tp2": (ep1["lp1"] - _joined(tp2, "lp1")).abs().max().item()}
    print(f"vs the single process after one step: adapters {worst} (the step moved them {moved:.2e}), "
          f"log-probs {lp}")
    # Adam's eps 1e-4: with 1e-6 it divides fp32 summation noise (EP sums in another order) by tiny gradients
    # and the adapters differ by up to 1.5e-5 (6e-7 with 1e-4)
    assert moved > 1e-3 and max(worst.values()) <= 1e-5 and max(lp.values()) <= 1e-5
    assert ep1["base_bit_identical"] and all(r["base_bit_identical"] for r in ep2 + tp2)


def test_exported_adapter_gives_the_stepped_model_in_peft(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, tmp, _, _, ep2, _ = runs
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                      str(tmp / "peft_ep2")).eval()
    got, mask = _hf_logprobs(model)
    gap = _gap(got, _joined(ep2, "lp1"), mask)
    print(f"peft with the EP2 export vs megatron after the step: {gap:.2e}")
    assert gap <= 1e-4


@pytest.mark.parametrize("saved_at", ["ep2", "eptp2"])
def test_ep2_checkpoint_resumes_in_one_process(runs, saved_at):
    from safetensors.torch import load_file

    path, tmp, _, _, _, _ = runs
    (steps,) = spawn_local(_resume_worker, 1, path, str(tmp / f"ckpt_{saved_at}"), str(tmp / f"resumed_{saved_at}"),
                           timeout=300)
    saved, resumed = (load_file(str(tmp / d / "adapter_model.safetensors"))
                      for d in (f"peft_{saved_at}", f"resumed_{saved_at}"))
    assert steps == 1 and saved.keys() == resumed.keys()
    assert all(torch.equal(saved[k], resumed[k]) for k in saved)


def test_export_cli_merges_the_ep2_checkpoint(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from megappo.export import export_lora

    path, tmp, _, _, ep2, _ = runs
    info = export_lora(tmp / "ckpt_ep2", tmp_path / "merged", path)
    assert info["merged_modules"] == 4 * (4 + 4 * 3) and info["adapter"]  # q/k/v/o + 4 experts x w1/w3/w2
    got, mask = _hf_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval())
    gap = _gap(got, _joined(ep2, "lp1"), mask)
    print(f"merged HF export of the EP2 checkpoint vs megatron after the step: {gap:.2e}")
    assert gap <= 1e-4


@pytest.mark.parametrize("actor", ["dp2_ep2", "tp2"])
def test_expert_lora_ppo_through_the_hybrid_engine(ray_session, tiny_assets, data_dir, tmp_path, actor):
    """configs/ppo_tiny_moe.yaml (tiny Qwen3-MoE, every role at DP2 x EP2; the actor also at TP2, its experts
    at expert TP 2) with LoRA on the actor's attention, dense MLP and experts, 2 steps: each sync's merged
    weights (every expert's W + alpha/r B@A, from the rank that trains it, from both TP halves at TP2) reach
    both vLLM engines (fingerprints), vLLM's log-probs equal Megatron's (fp32, <= 1e-4), the reference is the
    base (the KL loss to it is 0 at step 1, then the batch's k3) and the merged export is written; the peft
    adapter is skipped with its reason (this model's dense layer 0, see above). The config's rollout routing
    replay (r3) runs through the adapted experts: every captured route used as given."""
    from megappo.config.loader import load_config
    from test_lora_ppo import _k3 as k3_mean
    from trainer_utils import REPO, overrides, recording_updates, run

    cfg = load_config(REPO / "configs/ppo_tiny_moe.yaml", overrides(
        tiny_assets, data_dir, tmp_path, f"model.path={tiny_assets['tiny-qwen3_moe']}", "trainer.total_steps=2",
        "trainer.val_every=0", "trainer.save_every=2", "trainer.loggers=[jsonl]", "actor.lora.rank=4",
        "actor.lora.alpha=8", "actor.lora.experts=true", "actor.optim.lr=1e-3", "actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=false", "actor.ppo_mini_batch_size=8",  # one optimizer step a step
        *(["actor.parallel.tp=2", "actor.parallel.dp=1", "actor.parallel.ep=1"] if actor == "tp2" else [])))
    batches = []
    history, trainer = run(cfg, setup=recording_updates(batches))
    for h in history:
        assert h["rollout/weights_fingerprint_ok"] == 1.0
        assert h["rollout/logprob_diff_max"] <= 1e-4, h["rollout/logprob_diff_max"]
        # the config replays vLLM's routes (r3) through the adapted experts: every one used as given
        assert cfg.actor.router_replay == "r3" and h["actor/moe_replay_mismatch"] == 0, h["actor/moe_replay_mismatch"]
    # the reference is the base: pi_old equals it exactly at step 1 (every B = 0), the KL loss is 0 there and the
    # batch's k3 at step 2 (its only optimizer step runs at the weights that computed its pi_old)
    assert torch.equal(batches[0].batch["old_log_probs"], batches[0].batch["ref_log_prob"])
    assert history[0]["actor/kl_loss"] == 0.0
    assert history[1]["actor/kl_loss"] == pytest.approx(k3_mean(batches[1]), rel=1e-3) and k3_mean(batches[1]) > 1e-6
    assert (tmp_path / "hf_final" / "config.json").is_file() and not (tmp_path / "hf_final" / "adapter").exists()


def _merge_reads_worker(rank, world, port, path):
    import collections

    from megappo.models.lora import LoraConfig, MergedShard, lazily_merged_named_parameters
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.parallel.resharding import Resharder
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    layout = LAYOUTS[2]
    init_megatron(layout)
    eng = MegatronEngine(path, layout, EngineConfig(optim=OptimConfig(**OPTIM),
                                                    lora=LoraConfig(rank=RANK, alpha=ALPHA, experts=True)))
    res = Resharder(eng.inner_chunks(), eng.dims, layout, rollout_tp=1, transport="collective",
                    named_weights=lazily_merged_named_parameters)
    reads, read = collections.Counter(), MergedShard.detach

    def counted(self):
        reads[self._mod.lora_name] += 1
        return read(self)

    MergedShard.detach = counted
    try:
        sent = sum(len(b.tensors) for b in res.buckets())
    finally:
        MergedShard.detach = read
    return {"reads": dict(reads), "sent": sent, "ep_received": res.stats["bytes_ep_received"]}


def test_merged_sync_at_ep2_merges_each_adapted_weight_once(tiny_assets):
    """The merged weight sync at EP2 (collective transport): a rank broadcasts its own experts' merged weights to
    the other EP rank and sends the same tensors on, so every adapted weight, expert or dense, is merged once per
    sync (it used to merge its own experts twice: once for the broadcast, once more for the bucket)."""
    for r in spawn_local(_merge_reads_worker, 2, str(tiny_assets["tiny-mixtral"]), timeout=300):
        assert r["ep_received"] > 0 and r["sent"] > 0, r
        assert any(".experts." in n for n in r["reads"]) and set(r["reads"].values()) == {1}, r
