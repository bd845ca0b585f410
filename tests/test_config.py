"""Config system: defaults chain, overrides, typed schema, and one clear line per invalid case."""

import subprocess
import sys
from pathlib import Path

import pytest

from megappo.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))  # every shipped config, whatever its name
TINY = REPO / "configs" / "ppo_tiny.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    """Each file in configs/ loads and passes the full check (its layout fits its pool, batches divide,
    lengths fit the model). base.yaml is the defaults every other file starts from: it must hold too."""
    cfg = load_config(path)
    p = cfg.actor.parallel
    assert p.tp * p.cp * p.pp * p.dp == cfg.resources.nodes * cfg.resources.workers_per_node, path


def test_the_shipped_configs_are_the_ones_the_quickstart_names():
    names = {p.name for p in CONFIGS}
    assert {"base.yaml", "ppo_tiny.yaml", "grpo_tiny.yaml", "ppo_smollm2_135m.yaml", "grpo_smollm2_135m.yaml",
            "ppo_7b.yaml", "ppo_13b.yaml", "ppo_70b.yaml"} <= names
    guide = (REPO / "docs" / "quickstart.md").read_text()  # the configs table (the README links to it)
    assert all(f"configs/{n}" in guide for n in names - {"base.yaml"}), sorted(n for n in names if f"configs/{n}" not in guide)


def test_defaults_chain_and_overrides():
    cfg = load_config(TINY, ["trainer.total_steps=3", "rollout.temperature=0.7", "data.train_files=[a.parquet]"])
    assert cfg.trainer.total_steps == 3
    assert cfg.rollout.temperature == 0.7
    assert list(cfg.data.train_files) == ["a.parquet"]
    # from base.yaml, not restated in ppo_tiny.yaml
    assert cfg.algorithm.lam == 0.95
    assert cfg.reward.non_stop_penalty_value == -10.0
    # from the schema only
    assert cfg.trainer.worker_timeout_s == 600.0
    # the file itself wins over its defaults (base.yaml: lr 1e-6)
    assert cfg.actor.optim.lr == 3.0e-4


def test_nested_defaults_chain(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "a.yaml").write_text("defaults: [../b/base.yaml]\ntrainer: {seed: 7}\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "base.yaml").write_text(f"defaults: [{TINY}]\ntrainer: {{seed: 5, total_steps: 2}}\n")
    cfg = load_config(tmp_path / "a" / "a.yaml")
    assert (cfg.trainer.seed, cfg.trainer.total_steps, cfg.actor.optim.lr) == (7, 2, 3.0e-4)


def test_defaults_loop(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: [b.yaml]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "a.yaml")


# (overrides, substring the one-line error must contain)
INVALID = [
    (["actor.paralel.tp=2"], "did you mean actor.parallel"),
    (["trainer.totl_steps=2"], "did you mean trainer.total_steps"),
    (["rollout.temprature=0.5"], "did you mean rollout.temperature"),
    (["trainer.total_steps=abc"], "trainer.total_steps"),
    (["critic.parallel.dp=1"], "tp*pp*dp = 1*1*1 = 1 but the pool has 2 workers"),
    (["ref.parallel.tp=2", "ref.parallel.dp=2"], "tp*pp*dp = 2*1*2 = 4 but the pool has 2"),
    (["resources.workers_per_node=8", "actor.parallel.tp=8", "actor.parallel.dp=1", "critic.parallel.dp=8",
      "ref.parallel.dp=8"],
     "does not divide the model's 4 attention heads"),
    (["resources.workers_per_node=4", "actor.parallel.tp=4", "actor.parallel.dp=1", "critic.parallel.dp=4",
      "ref.parallel.dp=4"],
     "does not divide the model's 2 key/value heads"),
    (["model.arch.num_layers=3", "model.path=null", "actor.parallel.dp=1", "actor.parallel.pp=2"],
     "does not divide the model's 3 layers"),
    (["actor.parallel.dp=1", "actor.parallel.pp=2", "actor.parallel.vpp=4"], "pp*vpp = 8 does not divide"),
    (["actor.parallel.vpp=2"], "needs pipeline parallelism"),
    (["rollout.tp=4"], "rollout.tp=4 does not divide the actor world size (2)"),
    (["actor.ppo_mini_batch_size=12"], "does not divide the 128 sequences"),
    (["critic.ppo_mini_batch_size=8", "critic.micro_batch_size=8"], "not divisible by dp*micro_batch_size = 2*8"),
    (["actor.loss_agg_mode=mean"], "choose one of: token-mean"),
    (["algorithm.adv_estimator=grpo", "rollout.n=1", "data.train_batch_size=32"], "set rollout.n>=2"),
    (["rollout.temperature=0"], "must be > 0"),
    (["rollout.weight_load=fast"], "choose one of: auto, reload, direct"),
    (["rollout.cpu_linear=onednn"], "choose one of: packed, plain"),
    (["rollout.weight_load=reload", "rollout.cpu_linear=plain"], "needs rollout.weight_load=direct"),
    (["trainer.mode=async"], "resources.rollout_workers>=1"),
    (["trainer.loggers=[console,mlflow]"], "unknown logger 'mlflow'"),
    (["algorithm.use_kl_in_reward=true", "actor.use_kl_loss=true"], "KL is applied twice"),
    (["algorithm.filter_groups.metric=accuracy"], "algorithm.filter_groups.metric='accuracy' is not supported; "
     "choose one of: acc, score"),
    (["data.max_prompt_length=600"], "exceeds the model's 512 positions"),
    (["bogus"], "is not key=value"),
    (["trainer.rollout_check=ignore"], "choose one of: stop, warn, never"),
    (["trainer.rollout_logprob_bound=0"], "must be > 0 (null: the bound measured for the run's dtype)"),
    (["trainer.rollout_check_every=-1"], "must be >= 0"),
    (["model.path=null", "model.arch.family=gemma3"], "choose one of: llama, qwen2, mistral, qwen3, qwen3_moe"),
    (["actor.parallel.cp=2"], "actor.parallel tp*cp*pp*dp = 1*2*1*2 = 4 but the pool has 2 workers"),
    (["actor.parallel.cp=3"], "tp*cp*pp = 3 does not divide the pool's 2 workers"),
    (["critic.parallel.cp=0"], "critic.parallel.cp=0 must be a positive int"),
    (["resources.device=cuda", "model.transformer_engine=true", "ref.parallel.cp=2", "ref.parallel.dp=1"],
     "ref.parallel.cp=2 with model.transformer_engine=true: context parallel runs megappo's own CP attention"),
    (["actor.router_replay=r2"], "replays mixture-of-experts routes, and assets/tiny-llama-arith is a dense model"),
    (["actor.router_replay=r1"], "choose one of: off, r2, r3"),
]


@pytest.mark.parametrize("overrides,expected", INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_invalid_cases_one_line(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    msg = str(info.value)
    assert expected in msg
    assert "\n" not in msg


MOE_INVALID = [
    (["actor.parallel.ep=3"], "actor.parallel.ep=3 does not divide the model's 4 experts"),
    (["critic.parallel.ep=4"], "critic.parallel.ep=4 must divide critic.parallel.dp=2"),
    (["rollout.weight_load=reload"], "use rollout.weight_load=direct"),
    (["actor.pack_sequences=true", "actor.max_tokens_per_micro_batch=256"], "same number of them"),
    (["model.moe.token_dispatcher=flex"], "needs DeepEP on GPUs"),
    (["model.moe.token_dispatcher=allgather"], "use alltoall"),
    (["model.moe.aux_loss_coeff=-0.1"], "model.moe.aux_loss_coeff=-0.1 must be >= 0"),
    # the shipped MoE demo takes pi_old from the sampler: no pi_old forward to record routes in
    (["actor.router_replay=r2"], "set actor.use_rollout_log_probs=false and actor.proximal=recompute"),
    # (the shipped MoE demo replays the rollout's routes, r3, captured by a hook only an eager engine calls)
    (["rollout.enforce_eager=false"], "which CUDA graphs and torch.compile skip: set rollout.enforce_eager=true"),
]


@pytest.mark.parametrize("overrides,expected", MOE_INVALID, ids=[" ".join(o) for o, _ in MOE_INVALID])
def test_mixture_of_experts_layouts_refused_in_one_line(tiny_assets, overrides, expected):
    moe = [f"model.path={tiny_assets['tiny-qwen3_moe']}"]
    load_config(REPO / "configs/ppo_tiny_moe.yaml", moe)  # the shipped MoE layout (DP2 x EP2) is valid
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/ppo_tiny_moe.yaml", moe + overrides)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_role_sharing_the_actors_processes_with_another_ep_is_refused_in_one_line(tiny_assets):
    """A critic (colocated) or ref with the actor's tp/pp/dp/vpp runs in the actor's processes, under one
    megatron parallel_state: an ep of its own is refused before any worker starts."""
    moe = [f"model.path={tiny_assets['tiny-qwen3_moe']}"]
    for overrides, line in [
        (["critic.parallel.ep=1", "ref.parallel.ep=1"], "critic.parallel.ep=1 but actor.parallel.ep=2: a critic with "
         "the actor's tp/pp/dp/vpp runs in the actor's processes, under its expert-parallel groups; set "
         "critic.parallel.ep to 2 like actor.parallel.ep, or set resources.colocate=false"),
        (["ref.parallel.ep=1"], "ref.parallel.ep=1 but actor.parallel.ep=2: a ref with the actor's tp/pp/dp/vpp runs "
         "in the actor's processes, under its expert-parallel groups; set ref.parallel.ep to 2 like "
         "actor.parallel.ep, or give the ref its own tp/pp/dp"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(REPO / "configs/ppo_tiny_moe.yaml", moe + overrides)
        assert str(info.value) == line
    # a critic in its own processes may have its own ep
    load_config(REPO / "configs/ppo_tiny_moe.yaml", moe + ["critic.parallel.ep=1", "resources.colocate=false"])


def test_expert_parallel_on_a_dense_model_is_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["actor.parallel.ep=2"])
    assert "actor.parallel.ep=2 needs a mixture-of-experts model" in str(info.value) and "\n" not in str(info.value)


def test_check_paths(tmp_path):
    with pytest.raises(ConfigError, match="model.path=.*does not exist"):
        load_config(TINY, [f"model.path={tmp_path}/nope"], check_paths=True)


def test_validation_imports_no_torch(tiny_assets, data_dir, tmp_path):
    """`megappo train` starts Ray right after checking its config (paths and weight headers included),
    while a thread imports torch: the check itself must not import torch (1-1.5 s of start-up)."""
    code = (f"import sys; from megappo.config.loader import load_config; "
            f"load_config({str(TINY)!r}, ['model.path={tiny_assets['tiny-llama']}', "
            f"'data.train_files=[{data_dir}/arith_train.parquet]', 'data.val_files=[{data_dir}/arith_val.parquet]', "
            f"'trainer.output_dir={tmp_path}/out'], check_paths=True); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", out.stdout


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {total_steps: 3\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def _megappo(*args):
    return subprocess.run([sys.executable, "-m", "megappo.cli", *args], capture_output=True, text=True, cwd=REPO)


def test_cli_check_and_show():
    ok = _megappo("config", "check", "--config", str(TINY))
    assert ok.returncode == 0, ok.stderr
    bad = _megappo("config", "check", "--config", str(TINY), "actor.parallel.tp=3")
    assert bad.returncode == 1
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: actor.parallel"), bad.stderr
    shown = _megappo("config", "show", "--config", str(REPO / "configs/ppo_70b.yaml"), "trainer.total_steps=7")
    assert shown.returncode == 0, shown.stderr
    import yaml

    resolved = yaml.safe_load(shown.stdout)
    assert resolved["trainer"]["total_steps"] == 7
    assert resolved["actor"]["parallel"] == {"tp": 8, "pp": 2, "vpp": None, "dp": 4, "ep": 1, "cp": 1}


def test_cli_help_lists_subcommands():
    out = _megappo("--help")
    assert out.returncode == 0
    assert "config" in out.stdout and "assets" in out.stdout


def test_a_mixture_of_experts_checkpoint_missing_an_expert_or_with_more_is_refused_before_workers(tiny_assets, tmp_path):
    """`megappo train`'s path check (config check --paths) reads the safetensors headers: a missing expert
    tensor, or an expert beyond config.json's num_experts, is one line naming the fix."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_assets["tiny-qwen3_moe"]
    state = load_file(str(next(src.glob("*.safetensors"))))
    for case, edit, expected in [
        ("missing", lambda st: st.pop("model.layers.2.mlp.experts.3.up_proj.weight"),
         "lacks 1 routed-expert tensor(s) of its config.json's 4 experts, e.g. model.layers.2.mlp.experts.3.up_proj"),
        ("extra", lambda st: st.update({"model.layers.1.mlp.experts.4.up_proj.weight":
                                        st["model.layers.1.mlp.experts.0.up_proj.weight"].clone()}),
         "holds expert 4 but its config.json says num_experts=4"),
    ]:
        model = tmp_path / case
        shutil.copytree(src, model)
        for f in model.glob("*.safetensors"):
            f.unlink()
        st = dict(state)
        edit(st)
        save_file({k: v.contiguous() for k, v in st.items()}, str(model / "model.safetensors"))
        with pytest.raises(ConfigError) as info:
            load_config(REPO / "configs/ppo_tiny_moe.yaml", [f"model.path={model}"], check_paths=True)
        assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_deepseek_v3_refusals_are_one_line():
    """Multi-latent attention is mapped on megatron's local spec (TE's MLA spec is another mapping), and a
    model.arch without MLA's dims says which keys it needs."""
    cfg = REPO / "configs" / "grpo_deepseek_v3.yaml"
    with pytest.raises(ConfigError, match=r"^model.transformer_engine=true is not supported for multi-latent "
                                          r"attention \(deepseek_v3\).*leave it null$"):
        load_config(cfg, ["model.transformer_engine=true"])
    with pytest.raises(ConfigError, match=r"^model.arch: a deepseek_v3 config needs v_head_dim "):
        load_config(cfg, ["model.arch.head_dim=null"])
    # LoRA: MLA's projections, not linear_qkv (the default targets' fused q/k/v), and no vLLM adapter under MLA
    mla = "[linear_q_down_proj,linear_q_up_proj,linear_kv_down_proj,linear_kv_up_proj,linear_proj]"
    load_config(cfg, ["actor.lora.rank=16", f"actor.lora.target_modules={mla}"])
    with pytest.raises(ConfigError, match=r"^actor.lora.target_modules \['linear_qkv'\] name no linear of deepseek_v3: "
                                          r"its attention's are linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, "
                                          r"linear_kv_up_proj and linear_proj; set actor.lora.target_modules"):
        load_config(cfg, ["actor.lora.rank=16"])
    with pytest.raises(ConfigError, match=r"^rollout.lora_sync=adapter does not reach multi-latent attention: .*"
                                          r"use rollout.lora_sync=merged$"):
        load_config(cfg, ["actor.lora.rank=16", f"actor.lora.target_modules={mla}", "rollout.lora_sync=adapter"])
    with pytest.raises(ConfigError, match=r"^actor.lora.target_modules \['linear_q_up_proj'\] name no linear of llama: "
                                          r"those are multi-latent attention's"):
        load_config(REPO / "configs" / "ppo_tiny.yaml", ["actor.lora.rank=4", "actor.lora.target_modules=[linear_q_up_proj]"])
    load_config(cfg, ["actor.pack_sequences=true"])  # packed rows: each layer's YaRN RoPE by token position


def test_sigmoid_router_refusals_are_one_line(tiny_assets):
    """What megatron-core or vLLM would compute differently from transformers is refused before anything runs."""
    import json

    from megappo.parallel.model_dims import ModelDims

    raw = json.loads((tiny_assets["tiny-deepseek_v3"] / "config.json").read_text())
    assert ModelDims.from_hf_dict(raw).moe_groups == 2
    for change, line in [
        (dict(num_experts_per_tok=4), r"^deepseek_v3 n_group=2 with num_experts_per_tok=4 != 2 \* topk_group=1 is not "
                                      r"supported \(megatron scores a group by its top-\(k/topk_group\) experts"),
        (dict(norm_topk_prob=False), r"^deepseek_v3 norm_topk_prob=false with a sigmoid router is not supported"),
        (dict(topk_method="greedy"), r"^deepseek_v3 config.json needs topk_method 'noaux_tc' and scoring_func "),
        (dict(rope_interleave=False), r"^deepseek_v3 rope_interleave=false is not supported"),
    ]:
        with pytest.raises(ValueError, match=line):
            ModelDims.from_hf_dict(dict(raw, **change))


def test_warm_workers_rebuild_for_an_optimizer_build_key_and_reuse_for_its_hyper_parameters():
    """ppo/workers.build_key: the optimizer's hyper-parameters are run-level (the reset rebuilds the optimizer from
    them), distributed_optimizer is not (the DP wrapper is built with it): a run changing it gets new workers. Every
    field of the optimizer section is one or the other."""
    from dataclasses import fields

    from megappo.config.schema import OptimConfig
    from megappo.ppo.workers import _OPTIM_RUN_KEYS, build_key

    base = build_key(load_config(TINY))
    assert build_key(load_config(TINY, ["actor.optim.lr=1e-2", "critic.optim.warmup_steps=3"])) == base
    assert build_key(load_config(TINY, ["trainer.rollout_check=warn"])) == base
    for role in ("actor", "critic"):
        assert build_key(load_config(TINY, [f"{role}.optim.distributed_optimizer=false"])) != base
    assert {f.name for f in fields(OptimConfig)} - set(_OPTIM_RUN_KEYS) == {"distributed_optimizer"}
