"""Qwen2.5-VL through the rollout (fp32, CPU): VLLMRollout samples from rows with one image, two images of other
shapes and none (the prompts expanded by the processor, the images as PNG bytes), and the megatron actor's
log-probs of the sampled tokens (forward_only on the assembled rows, their pixels carried) equal vLLM's within 1e-3;
then the actor's weights are perturbed and pushed into vLLM the way the hybrid engine does: the fingerprints match
the vision tower's `visual.*` tensors included, and on the SAME images again (vLLM's encoder cache holds their
features) the log-probs still match, where a sync that keeps the encoder cache does not. Your own agent
(rollout.agent, an openai-SDK client through the gateway) sends each row's messages, its images as data URLs, then a
user turn with an image of its own: the rows hold both images' tokens exactly, with their pixels, and megatron's
log-probs of them match vLLM's. A row whose ids do not expand its image as vLLM does is refused. One process, one
vLLM engine."""

import os

import pytest
import torch

ROW_IMAGES = [[(112, 112)], [(56, 56), (112, 56)], []]  # (height, width) in pixels; 112 x 112 is 16 tokens
N, R, TEMPERATURE, TOL = 2, 6, 0.8, 1e-3
AGENT_R, AGENT_IMAGE = 40, (56, 56)  # the agent's session budget; its own image's size (4 image tokens)


def _agent_image(index: int) -> bytes:
    from tests.vision_helpers import png

    return png(*AGENT_IMAGE, seed=100 + index)


async def _agent(client, row):
    """Your own agent: the row's messages as given (its images as image_url parts), then a user turn with an image."""
    from megappo.utils.images import data_url

    messages = list(row["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": [{"type": "text", "text": "and here?"},
                                              {"type": "image_url", "image_url": {"url": data_url(_agent_image(
                                                  row["index"]))}}]}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    return 1.0


def _prompts(path):
    from tests.vision_helpers import vl_prompts

    return vl_prompts(path, ROW_IMAGES)


def _job(rank, world, port, path, layout=None, rollout_tp=1):
    """The module's checks in one process (`layout` / `rollout_tp`: also run by hand at TP2 -> rollout TP1 / TP2
    and PP2 -> TP1, two processes)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from megappo.config.schema import RolloutConfig
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.protocol import DataProto
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine
    from megappo.models.vision import vision_tensors
    from megappo.workers.rollout.hybrid_engine import HybridEngine, WeightSyncError
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    init_distributed(rank, world, master_port=port)
    layout = ParallelLayout(**(layout or {}))
    init_megatron(layout, seed=0)
    engine = MegatronEngine(path, layout, EngineConfig())
    rollout = VLLMRollout(path, RolloutConfig(tp=rollout_tp, max_new_tokens=R, kv_cache_memory_mb=32), seed=0,
                          dtype="float32", max_model_len=256)
    hybrid = HybridEngine(engine, rollout)
    prompts = _prompts(path)
    prompts.meta_info["sampling"] = SamplingSpec(n=N, temperature=TEMPERATURE, max_new_tokens=R, seed=5)
    report = {"limit": rollout.llm.llm_engine.model_config.multimodal_config.get_limit_per_prompt("image")}

    def rollout_round(key):
        with hybrid:  # the sync: resharder buckets -> load_weights -> caches reset -> fingerprint check
            out = hybrid.generate_sequences(prompts)
        report[key] = {"parity": hybrid.logprob_parity(out, micro_batch_size=2),
                       "fingerprint_ok": hybrid.metrics["rollout/weights_fingerprint_ok"],
                       "visual_compared": sorted(n for n in set(hybrid.resharder.expected_fingerprints)
                                                 & set(rollout.fingerprint()) if n.startswith("visual."))}
        return out

    out = rollout_round("initial")
    report["out"] = {k: out.batch[k] for k in ("input_ids", "response_mask", "pixel_values", "image_grid_thw")}
    report["out_images"] = list(out.non_tensor_batch["images"])
    report["prompts"] = {k: prompts.batch[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}

    def perturb(seed):  # every weight, the vision tower's too, by ~20% of its spread; not the tied embedding (a
        g = torch.Generator().manual_seed(seed)  # pipeline's last stage holds a copy that training keeps equal)
        with torch.no_grad():
            for name, p in ((n, p) for c in engine.inner_chunks() for n, p in c.named_parameters()):
                if "word_embeddings" not in name and "output_layer" not in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.2 * (p.std() if p.numel() > 1 else 1.0))

    perturb(1)
    rollout_round("perturbed")  # the same images: their features are in vLLM's encoder cache
    perturb(2)  # a sync that keeps the encoder cache: the repeated images' features are the old tower's
    reset = rollout.llm.llm_engine.reset_encoder_cache
    rollout.llm.llm_engine.reset_encoder_cache = lambda: None
    rollout_round("stale")
    rollout.llm.llm_engine.reset_encoder_cache = reset

    # your own agent through the gateway, on the same engine
    from megappo.data.images import processor_for
    from megappo.gateway.agents import AgentRunner
    from megappo.workers.rollout.async_engine import AsyncTokenEngine

    rollout.agent = AgentRunner(AsyncTokenEngine.for_llm(rollout.llm), rollout.tokenizer, _agent, max_model_len=256,
                                max_tokens=R, processor=processor_for(path))
    asked = DataProto(dict(prompts.batch), dict(prompts.non_tensor_batch),
                      {"sampling": SamplingSpec(n=1, temperature=TEMPERATURE, max_new_tokens=AGENT_R, seed=7)})
    with hybrid:
        got = hybrid.generate_sequences(asked)
    report["agent"] = {"parity": hybrid.logprob_parity(got, micro_batch_size=1),
                       **{k: got.batch[k] for k in ("prompts", "responses", "response_mask", "pixel_values",
                                                    "image_grid_thw", "agent_errors")}}
    rollout.agent.close()
    rollout.agent = None

    # a vision weight changed in flight (a row of qkv's k block: vLLM's fused vision qkv read back through its kernel)
    def corrupt(bucket):
        for name, t in bucket.tensors:
            if name == "visual.blocks.1.attn.qkv.weight":
                t[t.shape[0] // 2, 0] += 0.5

    hybrid.corrupt_hook = corrupt
    try:
        with hybrid:
            pass
        report["corruption_error"] = None
    except WeightSyncError as e:
        report["corruption_error"] = str(e)
    hybrid.corrupt_hook = None
    report["tower"] = sorted(vision_tensors(engine.hf_config))

    # a row whose ids expand its 112 x 112 image, carrying a 56 x 56 one: vLLM's prompt differs, refused
    bad = DataProto(dict(prompts.batch), dict(prompts.non_tensor_batch), dict(prompts.meta_info))
    bad.non_tensor_batch["images"] = prompts.non_tensor_batch["images"].copy()
    bad.non_tensor_batch["images"][0] = [prompts.non_tensor_batch["images"][1][0]]
    try:
        rollout.generate_sequences(bad)
        report["mismatch_error"] = None
    except ValueError as e:
        report["mismatch_error"] = str(e)
    return report


@pytest.fixture(scope="module")
def report(tiny_assets):
    from megappo.parallel.launch import spawn_local

    return spawn_local(_job, 1, str(tiny_assets["tiny-qwen2_5_vl"]), timeout=600)[0]


def test_rollout_carries_the_images(report):
    """n samples per prompt: each sample's row carries its prompt's pixels, grids and image bytes."""
    out, B = report["out"], len(ROW_IMAGES)
    assert out["input_ids"].shape[0] == B * N and bool(out["response_mask"].any())
    for k, v in report["prompts"].items():
        assert torch.equal(out[k][:, :v.shape[1]], v.repeat_interleave(N, 0)), k
    grids = out["image_grid_thw"]
    assert [int((grids[k, :, 0] > 0).sum()) for k in range(B * N)] == [len(s) for s in ROW_IMAGES for _ in range(N)]
    assert [len(x) for x in report["out_images"]] == [len(s) for s in ROW_IMAGES for _ in range(N)]
    assert report["limit"] == 256 // 3


@pytest.mark.parametrize("key", ["initial", "perturbed"])
def test_logprobs_match_megatron(report, key):
    """vLLM's sampled log-probs equal the megatron actor's on the same rows (its images through its own tower),
    before and after the weights moved; the fingerprints cover the vision tower."""
    r = report[key]
    print(f"{key}: max |dlogp| {r['parity']['rollout/logprob_diff_max']:.2e}, {len(r['visual_compared'])} visual.* "
          "tensors fingerprinted")
    assert r["fingerprint_ok"] == 1.0
    assert r["visual_compared"] == report["tower"], r["visual_compared"]  # every tensor of the tower
    assert r["parity"]["rollout/logprob_diff_max"] <= TOL, r["parity"]


def test_a_kept_encoder_cache_is_stale(report):
    """The control: without the encoder-cache reset the repeated images' log-probs move away from megatron's
    (the weights' fingerprints still pass: the stale part is vLLM's cache, not its weights)."""
    r = report["stale"]
    print(f"encoder cache kept: max |dlogp| {r['parity']['rollout/logprob_diff_max']:.2e}")
    assert r["fingerprint_ok"] == 1.0
    assert r["parity"]["rollout/logprob_diff_max"] > 1e-2, r["parity"]


def test_a_prompt_vllm_expands_otherwise_is_refused(report):
    err = report["mismatch_error"]
    assert err is not None and err.startswith("prompt row 0: vLLM expanded its images") and "\n" not in err, err


def test_a_vision_weight_changed_in_flight_is_caught(report):
    err = report["corruption_error"]
    assert err is not None and "differ from the trainer" in err and "visual.blocks.1.attn.qkv.weight" in err, err


def test_your_own_agents_images_reach_the_trained_rows(report, tiny_assets):
    """rollout.agent: each row is its prompt as the data expanded it, the agent's turns, and between them its user
    turn with its own image, whose pad run (4 tokens, untrained) and pixels the row holds after the prompt's; megatron
    scores the sampled tokens as vLLM sampled them (its positions and features of both images)."""
    from transformers import AutoProcessor

    from megappo.data.images import decode

    got, prompts = report["agent"], report["prompts"]
    processor = AutoProcessor.from_pretrained(str(tiny_assets["tiny-qwen2_5_vl"]))
    pad = processor.image_token_id
    print(f"agent rows: max |dlogp| {got['parity']['rollout/logprob_diff_max']:.2e}")
    assert got["agent_errors"].sum() == 0
    assert torch.equal(got["prompts"][:, -prompts["input_ids"].shape[1]:], prompts["input_ids"])  # the row's prompt
    for k, sizes in enumerate(ROW_IMAGES):
        mask, resp = got["response_mask"][k], got["responses"][k]
        pads = ((resp == pad) & (mask == 0)).nonzero().flatten()
        assert len(pads) == 4 and bool((pads.diff() == 1).all()), (k, pads)  # one untrained run of 4, in the turn
        assert mask[:pads[0]].sum() > 0 and mask[pads[-1]:].sum() > 0  # between two sampled turns
        own = processor.image_processor(images=[decode(_agent_image(k))], return_tensors="pt")
        first = int(prompts["image_grid_thw"][k].prod(-1).sum())  # the prompt's images' patches come first
        assert torch.equal(got["pixel_values"][k, :first], prompts["pixel_values"][k, :first])
        assert torch.equal(got["pixel_values"][k, first:first + own["pixel_values"].shape[0]], own["pixel_values"])
        assert got["image_grid_thw"][k, len(sizes)].tolist() == own["image_grid_thw"][0].tolist()
    assert got["parity"]["rollout/logprob_diff_max"] <= TOL, got["parity"]
