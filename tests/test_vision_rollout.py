"""Qwen2.5-VL through the rollout (fp32, CPU): VLLMRollout samples from rows with one image, two images of other
shapes and none (the prompts expanded by the processor, the images as PNG bytes), and the megatron actor's
log-probs of the sampled tokens (forward_only on the assembled rows, their pixels carried) equal vLLM's within 1e-3;
then the actor's weights are perturbed and pushed into vLLM the way the hybrid engine does: the fingerprints match
the vision tower's `visual.*` tensors included, and on the SAME images again (vLLM's encoder cache holds their
features) the log-probs still match, where a sync that keeps the encoder cache does not. A row whose ids do not
expand its image as vLLM does is refused. One process, one vLLM engine."""

import os

import pytest
import torch

ROW_IMAGES = [[(112, 112)], [(56, 56), (112, 56)], []]  # (height, width) in pixels; 112 x 112 is 16 tokens
N, R, TEMPERATURE, TOL = 2, 6, 0.8, 1e-3


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
