"""Megatron log-probs / entropy / values under TP2xPP2 and PP2xVPP2(xDP2) equal a HuggingFace
transformers forward on the same weights (fp32, CPU, gloo), for tiny llama, qwen2 (tied embeddings, qkv
bias), mistral, qwen3 (q/k norms, head_dim 64), qwen3-moe (4 experts, top-2, a dense first layer;
vocab 1000 padded to 1024), mixtral (every layer 4 experts, top-2) and qwen2-moe (top-2 not renormalised, a
gated shared expert, qkv bias, vocab 1001) and glm4-moe (GLM-4.5: a dense first layer, 8 experts under a sigmoid
router with a non-zero correction bias, top-2 renormalised and scaled 2.5, a shared expert, q/k norms, RoPE on half
of each head); the MoE models also with their
experts split over 2 expert-parallel ranks, with TP2 and with PP2. Left- and right-padded rows are compared with HF run on each row WITHOUT
padding. One 4-process launch does every check."""

import math
import re

import pytest
import torch

from megappo.models.gpt import ValueHead
from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout

LAYOUTS = [ParallelLayout(tp=2, pp=2), ParallelLayout(pp=2, vpp=2, dp=2),
           ParallelLayout(tp=2, dp=2, ep=2), ParallelLayout(pp=2, dp=2, ep=2)]  # expert parallel: MoE only
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-qwen3", "tiny-qwen3_moe", "tiny-mixtral", "tiny-qwen2_moe",
            "tiny-glm4_moe", "tiny-deepseek_v3", "tiny-deepseek_v3_lite"]
MOE = ("tiny-qwen3_moe", "tiny-mixtral", "tiny-qwen2_moe", "tiny-glm4_moe", "tiny-deepseek_v3", "tiny-deepseek_v3_lite")
CASES = [(fam, li) for li, layout in enumerate(LAYOUTS) for fam in FAMILIES if layout.ep == 1 or fam in MOE]
TEMPERATURE = 0.7
B, S, R = 4, 16, 7
SEED = 1234


def make_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (B, S), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :6] = 0
    mask[3, -2:] = 0  # right padding inside the response
    return ids, mask


def _worker(rank, world, port, paths):
    from megappo.parallel.megatron_init import coords, init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine

    init_distributed(rank, world, "127.0.0.1", port)
    ids, mask = make_batch()
    out = {"coords": {}, "results": {}}
    for li, layout in enumerate(LAYOUTS):
        init_megatron(layout, seed=SEED)
        from megatron.core import parallel_state as mpu

        out["coords"][li] = coords()
        dp, n = mpu.get_data_parallel_rank(), B // layout.dp
        sl = slice(dp * n, (dp + 1) * n)
        batch = {"input_ids": ids[sl], "attention_mask": mask[sl]}
        mbs = n // (2 if layout.pp > 1 else 1)
        for fam in [f for f, i in CASES if i == li]:
            for role in ("actor", "critic") if li == 0 else ("actor",):
                head = {"actor": "lm", "critic": "value"}[role]
                eng = MegatronEngine(paths[fam], layout, EngineConfig(head=head, seed=SEED))
                res = eng.forward_only(batch, response_length=R, micro_batch_size=mbs, temperature=TEMPERATURE)
                if res is not None and mpu.get_tensor_model_parallel_rank() == 0:
                    out["results"][(li, fam, role, dp)] = res
                del eng
    return out


@pytest.fixture(scope="module")
def megatron_outputs(tiny_assets):
    paths = {f: str(tiny_assets[f]) for f in FAMILIES}
    return spawn_local(_worker, 4, paths, timeout=900)


def _hf_reference(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = make_batch()
    lp, ent, hidden = [], [], []
    with torch.no_grad():
        for b in range(B):
            keep = mask[b].bool()
            row = ids[b][keep][None]
            o = model(row, output_hidden_states=True)
            # positions of this row's tokens inside the padded row
            pos = keep.nonzero()[:, 0]
            full_lp = torch.zeros(S)
            full_ent = torch.zeros(S)
            full_h = torch.zeros(S, model.config.hidden_size)
            logits = o.logits[0].float() / TEMPERATURE
            logsm = torch.log_softmax(logits, -1)
            # token t (t >= 1 in the unpadded row) is predicted at t-1
            full_lp[pos[1:]] = logsm[:-1].gather(-1, row[0, 1:, None])[:, 0]
            full_ent[pos[1:]] = -(logsm[:-1].exp() * logsm[:-1]).sum(-1)
            full_h[pos] = o.hidden_states[-1][0]
            lp.append(full_lp[S - R:])
            ent.append(full_ent[S - R:])
            hidden.append(full_h)
    valid = torch.zeros(B, R, dtype=torch.bool)
    for b in range(B):
        valid[b] = mask[b, S - R:].bool() & (mask[b].cumsum(0)[S - R:] > 1)
    return torch.stack(lp), torch.stack(ent), torch.stack(hidden), valid


def _collect(outputs, li, fam, role, layout):
    parts = []
    for d in range(layout.dp):
        found = [o["results"][(li, fam, role, d)] for o in outputs if (li, fam, role, d) in o["results"]]
        assert len(found) == 1, f"expected one collect rank for dp={d}, got {len(found)}"
        parts.append(found[0])
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def test_layout_matches_megatron_rank_order(megatron_outputs):
    for li, layout in enumerate(LAYOUTS):
        for rank, o in enumerate(megatron_outputs):
            assert tuple(o["coords"][li]) == layout.coords(rank) + (layout.cp_rank(rank),), (str(layout), rank)


@pytest.mark.parametrize("fam,li", CASES, ids=[f"{f}-{LAYOUTS[i]}" for f, i in CASES])
def test_logprobs_and_entropy_match_hf(megatron_outputs, tiny_assets, fam, li):
    ref_lp, ref_ent, _, valid = _hf_reference(str(tiny_assets[fam]))
    got = _collect(megatron_outputs, li, fam, "actor", LAYOUTS[li])
    assert got["logprobs"].shape == (B, R) and got["entropy"].shape == (B, R)
    lp_diff = (got["logprobs"] - ref_lp)[valid].abs().max().item()
    ent_diff = (got["entropy"] - ref_ent)[valid].abs().max().item()
    print(f"{fam} {LAYOUTS[li]}: max|dlogp|={lp_diff:.2e} max|dH|={ent_diff:.2e}")
    assert lp_diff <= 1e-4 and ent_diff <= 1e-4
    # the check has teeth: log-probs are far from uniform and differ between tokens
    assert ref_lp[valid].std() > 0.5 and (ref_lp[valid] < -math.log(1000) + 3).any()


@pytest.mark.parametrize("fam", FAMILIES)
def test_critic_values_match_hf_hidden_states(megatron_outputs, tiny_assets, fam):
    _, _, hidden, valid = _hf_reference(str(tiny_assets[fam]))
    h = hidden.shape[-1]
    w = ValueHead(h, seed=SEED).weight.detach()  # the head megatron's critic starts from (bias 0)
    ref = (hidden @ w.T)[..., 0][:, S - R - 1:S - 1]  # value of the state before each response token
    got = _collect(megatron_outputs, 0, fam, "critic", LAYOUTS[0])["values"]
    assert got.shape == (B, R)
    assert (got - ref)[valid].abs().max().item() <= 1e-4
    assert ref[valid].abs().max() > 0.02  # values are not all ~0: the check has teeth


def test_logprobs_cli_refuses_an_expert_parallel_size_that_does_not_fit_in_one_line(tiny_assets, tmp_path):
    """`megappo logprobs --ep`: EP ranks are DP ranks (the engine's EP results are the layouts above)."""
    from cli_helpers import run_cli

    (tmp_path / "rows.jsonl").write_text('{"input_ids": [5, 6, 7], "response_start": 1}\n')
    rc, _, stderr = run_cli("logprobs", "--model", tiny_assets["tiny-qwen3_moe"], "--input", tmp_path / "rows.jsonl",
                            "--out", tmp_path / "lp.safetensors", "--dp", "2", "--ep", "3")
    assert rc == 2 and re.search(r"ep=3 must divide (\S+\.)?dp=2", stderr) and "Traceback" not in stderr, stderr
