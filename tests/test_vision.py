"""Qwen2.5-VL on megatron (models/vision_gpt.py) against transformers on the same weights (fp32, CPU, gloo): rows with
one image, two images of other shapes, and none, left-padded prompts and a right-padded response; log-probs within
1e-4 of Qwen2_5_VLForConditionalGeneration run on each row unpadded, at DP2, TP2 (sequence parallel) and PP2 (the
vision tower on the first stage), each unpacked and packed. M-RoPE's positions equal transformers' get_rope_index.
One update step moves the vision tower's weights, identically on both TP ranks, and none of them when it is frozen."""

import pytest
import torch

from megappo.parallel.launch import spawn_local
from megappo.parallel.layout import ParallelLayout

R = 6
TEMPERATURE = 0.8
LAYOUTS = [ParallelLayout(dp=2), ParallelLayout(tp=2), ParallelLayout(pp=2)]
# each row's images as (height, width) in pixels; 112 x 112 is 16 tokens, 56 x 56 four, 112 x 56 eight
ROW_IMAGES = [[(112, 112)], [(56, 56), (112, 56)], [], [(56, 112)]]


def make_batch(path):
    """The rows as the engine takes them: [B, S] ids / mask (left-padded prompts, R response columns, the last row's
    response 2 short), pixel_values [B, P, D] and image_grid_thw [B, 2, 3], zeros past each row's own."""
    from tests.vision_helpers import vl_prompts

    prompts = vl_prompts(path, ROW_IMAGES).batch
    g = torch.Generator().manual_seed(0)
    b, width = prompts["input_ids"].shape
    ids = torch.cat([prompts["input_ids"], torch.randint(0, 1000, (b, R), generator=g)], dim=1)
    mask = torch.cat([prompts["attention_mask"], torch.ones(b, R, dtype=torch.long)], dim=1)
    mask[-1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": prompts["pixel_values"],
            "image_grid_thw": prompts["image_grid_thw"]}


def _hf_logprobs(path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    batch = make_batch(path)
    out = torch.zeros(len(ROW_IMAGES), R)
    for i in range(len(ROW_IMAGES)):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        grids = batch["image_grid_thw"][i][batch["image_grid_thw"][i, :, 0] > 0]
        extra = {}
        if len(grids):
            extra = dict(pixel_values=batch["pixel_values"][i, :int(grids.prod(-1).sum())], image_grid_thw=grids,
                         mm_token_type_ids=(ids == model.config.image_token_id).long())
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0].float() / TEMPERATURE
        n = int(keep[-R:].sum())  # this row's response tokens
        logp = torch.log_softmax(logits[-n - 1:-1], -1).gather(-1, ids[0, -n:, None])[:, 0]
        out[i, :n] = logp
    return out


def test_mrope_positions_match_transformers(tiny_assets):
    """models/vision.mrope_positions on left-padded rows equals transformers' get_rope_index (images of three
    shapes, two in one row, a row with none)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megappo.models.vision import mrope_positions

    path = tiny_assets["tiny-qwen2_5_vl"]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    batch = make_batch(path)
    ids, mask, grids = batch["input_ids"], batch["attention_mask"], batch["image_grid_thw"]
    ours, where = mrope_positions(ids, mask, grids, model.config.image_token_id, 2, prompt_end=ids.shape[1] - R)
    for i in range(len(ROW_IMAGES)):
        keep = mask[i].bool()
        row_grids = grids[i][grids[i, :, 0] > 0]
        pads = (ids[i][keep] == model.config.image_token_id)[None]
        if len(row_grids):
            theirs, _ = model.model.get_rope_index(ids[i][keep][None], mm_token_type_ids=pads.long(),
                                                   image_grid_thw=row_grids)
            theirs = theirs[:, 0].t()
        else:
            theirs = torch.arange(int(keep.sum()))[:, None].expand(-1, 3)
        assert torch.equal(ours[i][keep], theirs), i
        assert int(where[i].sum()) == int((row_grids.prod(-1) // 4).sum())


def _worker(rank, world, port, path, converted):
    from megatron.core import parallel_state as mpu

    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine, OptimConfig

    init_distributed(rank, world, "127.0.0.1", port)
    batch = make_batch(path)
    out = {"logprobs": {}, "visual": {}}
    for li, layout in enumerate(LAYOUTS):
        init_megatron(layout, seed=0)
        dp, n = mpu.get_data_parallel_rank(), len(ROW_IMAGES) // layout.dp
        mine = {k: v[dp * n:(dp + 1) * n] for k, v in batch.items()}
        for packed in (False, True):
            eng = MegatronEngine(path, layout, EngineConfig(pack_sequences=packed, sequence_parallel=layout.tp > 1))
            res = eng.forward_only(mine, response_length=R, micro_batch_size=2 if layout.pp > 1 else n,
                                   temperature=TEMPERATURE)
            if res is not None:
                out["logprobs"][(li, packed, dp)] = res["logprobs"]
            if li == 0 and not packed:  # the images reach the language model: other pixels, other log-probs
                blank = eng.forward_only(dict(mine, pixel_values=torch.zeros_like(mine["pixel_values"])),
                                         response_length=R, micro_batch_size=n, temperature=TEMPERATURE)
                out["blank"] = (res["logprobs"] - blank["logprobs"]).abs().amax(-1)
            del eng
    # the converter's megatron checkpoint (written at TP2) loads into the engine at TP2: megatron's own keys
    init_megatron(LAYOUTS[1], seed=0)
    eng = MegatronEngine(converted, LAYOUTS[1], EngineConfig(sequence_parallel=True))
    out["converted"] = eng.forward_only(batch, response_length=R, micro_batch_size=4, temperature=TEMPERATURE)["logprobs"]
    del eng
    # one update at TP2: the vision tower's weights move (the same on both ranks), or stay when frozen
    init_megatron(LAYOUTS[1], seed=0)
    for frozen in (False, True):
        eng = MegatronEngine(path, LAYOUTS[1], EngineConfig(optim=OptimConfig(lr=1e-2), sequence_parallel=True,
                                                            freeze_vision=frozen))
        before = {k: p.detach().clone() for k, p in eng.model[0].module.visual.named_parameters()}

        def loss_fn(outs, mb):
            mask = mb["attention_mask"][:, -R:].float() if "attention_mask" in mb else 1.0
            return -(outs["logprobs"] * mask).sum(), {}

        eng.train_step(batch, loss_fn, normalizer=float(len(ROW_IMAGES) * R), response_length=R, micro_batch_size=4)
        after = dict(eng.model[0].module.visual.named_parameters())
        out["visual"][frozen] = {k: after[k].detach() - before[k] for k in before}
        del eng
    return out


@pytest.fixture(scope="module")
def converted(tiny_assets, tmp_path_factory):
    from megappo.conversion.to_mcore import hf_to_mcore

    out = tmp_path_factory.mktemp("vl") / "mcore"
    hf_to_mcore(tiny_assets["tiny-qwen2_5_vl"], out, tp=2, pp=2, progress=False)
    return out


@pytest.fixture(scope="module")
def megatron_outputs(tiny_assets, converted):
    return spawn_local(_worker, 2, str(tiny_assets["tiny-qwen2_5_vl"]), str(converted), timeout=900)


def test_converter_round_trip_is_bit_exact(tiny_assets, converted, tmp_path):
    """HF -> megatron (TP2 x PP2 hint) -> HF gives back every tensor, the vision tower's included, bit for bit."""
    from safetensors.torch import load_file

    from megappo.conversion.to_hf import mcore_to_hf

    src = tiny_assets["tiny-qwen2_5_vl"]
    mcore_to_hf(converted, tmp_path / "hf", progress=False)
    a, b = load_file(str(src / "model.safetensors")), {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        b.update(load_file(str(f)))
    assert sorted(a) == sorted(b) and any(k.startswith("visual.") for k in a)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "hf" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_converted_checkpoint_loads_into_the_engine(megatron_outputs, tiny_assets):
    ref = _hf_logprobs(tiny_assets["tiny-qwen2_5_vl"])
    mask = make_batch(tiny_assets["tiny-qwen2_5_vl"])["attention_mask"][:, -R:].bool()
    assert (megatron_outputs[0]["converted"] - ref).abs()[mask].max() <= 1e-4


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("li", range(len(LAYOUTS)), ids=["dp2", "tp2", "pp2"])
def test_logprobs_match_transformers(megatron_outputs, tiny_assets, li, packed):
    ref = _hf_logprobs(tiny_assets["tiny-qwen2_5_vl"])
    layout = LAYOUTS[li]
    n = len(ROW_IMAGES) // layout.dp
    got = torch.zeros_like(ref)
    for rank_out in megatron_outputs:
        for (i, p, dp), lp in rank_out["logprobs"].items():
            if (i, p) == (li, packed):
                got[dp * n:(dp + 1) * n] = lp
    mask = make_batch(tiny_assets["tiny-qwen2_5_vl"])["attention_mask"][:, -R:].bool()
    gap = (got - ref).abs()[mask].max().item()
    print(f"max |dlogp| {gap:.2e}")
    assert gap <= 1e-4, gap


def test_images_change_the_logprobs(megatron_outputs):
    gaps = torch.cat([out["blank"] for out in megatron_outputs])  # per row: rows 0, 1, 3 have images, row 2 none
    assert gaps[2] == 0 and min(gaps[0], gaps[1], gaps[3]) > 1e-2, gaps


def test_vision_tower_trains_or_stays_frozen(megatron_outputs):
    moved = [{k: float(d.abs().max()) for k, d in out["visual"][False].items()} for out in megatron_outputs]
    assert min(moved[0].values()) > 0, [k for k, v in moved[0].items() if v == 0]
    for k, d in megatron_outputs[0]["visual"][False].items():  # replicated over TP: the same update on both ranks
        assert torch.equal(d, megatron_outputs[1]["visual"][False][k]), k
    assert all(float(d.abs().max()) == 0 for out in megatron_outputs for d in out["visual"][True].values())


def test_dataset_rows_carry_their_images(tiny_assets, tmp_path):
    """A parquet `images` column (bytes, a path beside the file, {"bytes"}) through RLHFDataset and collate: the
    prompt's ids hold each image expanded as the processor expands it, the batch its pixels in models/vision.py's
    layout, a text-only row zeros; bad inputs are one line each."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoProcessor, AutoTokenizer

    from megappo.data.dataset import RLHFDataset
    from tests.vision_helpers import png

    path = tiny_assets["tiny-qwen2_5_vl"]
    processor, tok = AutoProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)

    (tmp_path / "a.png").write_bytes(png(56, 112, 2))
    label = dict(data_source="count", reward_model={"ground_truth": "1", "style": "rule"})
    # one file of encoded bytes (and a row without images), one of datasets' {"bytes", "path"} (a path beside it)
    pq.write_table(pa.Table.from_pylist([dict(label, prompt="how many?", images=[png(112, 112, 1)]),
                                         dict(label, prompt="no picture here", images=[])]), tmp_path / "a.parquet")
    two = [{"bytes": None, "path": "a.png"}, {"bytes": png(56, 56, 3), "path": None}]
    pq.write_table(pa.Table.from_pylist([dict(label, prompt=[{"role": "user", "content": "first <image> then <image>?"}],
                                              images=two)]), tmp_path / "b.parquet")
    ds = RLHFDataset([tmp_path / "a.parquet", tmp_path / "b.parquet"], tok, max_prompt_length=128, processor=processor)
    batch = ds.get_batch([0, 2, 1])
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [int((batch.batch["input_ids"][i] == pad).sum()) for i in range(3)] == [16, 8 + 4, 0]
    assert batch.batch["image_grid_thw"].tolist() == [[[1, 8, 8], [0, 0, 0]], [[1, 4, 8], [1, 4, 4]],
                                                      [[0, 0, 0], [0, 0, 0]]]  # a.png is 56 x 112: 4 x 8 patches
    assert batch.batch["pixel_values"].shape == (3, 64, 1176) and batch.batch["pixel_values"][2].abs().sum() == 0
    assert [len(x) for x in batch.non_tensor_batch["images"]] == [1, 2, 0]
    # the second row's pixels are the processor's own on its two images, in order
    from megappo.data.images import decode

    theirs = processor.image_processor(images=[decode(b) for b in ds[2]["images"]], return_tensors="pt")
    assert torch.equal(batch.batch["pixel_values"][1, :48], theirs["pixel_values"])
    with pytest.raises(ValueError, match="has an images column but the model is a text model"):
        RLHFDataset(tmp_path / "a.parquet", tok, max_prompt_length=128)
    for bad, match in ((["https://x.org/a.png"], "megappo fetches nothing"), (["missing.png"], "is not a file"),
                       ([png(56, 56, 0), png(56, 56, 1)], "marks 1 image")):
        pq.write_table(pa.Table.from_pylist([dict(label, prompt="one <image> only", images=bad)]),
                       tmp_path / "bad.parquet")
        with pytest.raises(ValueError, match=match):
            RLHFDataset(tmp_path / "bad.parquet", tok, max_prompt_length=128, processor=processor)


def test_logprobs_cli_scores_rows_with_images(tiny_assets, tmp_path):
    """`megappo logprobs` on rows carrying images (paths beside the input file): transformers' log-probs within 1e-4
    at TP2; a row whose ids do not expand its image is refused in one line before any worker starts."""
    import json

    from safetensors.torch import load_file

    from tests.cli_helpers import run_cli
    from tests.vision_helpers import png

    path = tiny_assets["tiny-qwen2_5_vl"]
    batch, ref = make_batch(path), _hf_logprobs(path)
    lines = []
    for i, sizes in enumerate(ROW_IMAGES):
        names = []
        for k, (h, w) in enumerate(sizes):
            (tmp_path / f"{i}_{k}.png").write_bytes(png(h, w, 10 * i + k))
            names.append(f"{i}_{k}.png")
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep].tolist()
        lines.append({"input_ids": ids, "response_start": len(ids) - int(keep[-R:].sum()), "images": names})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cmd = ["logprobs", "--model", path, "--tp", "2", "--input", tmp_path / "rows.jsonl", "--out",
           tmp_path / "lp.safetensors", "--temperature", TEMPERATURE]
    rc, _, stderr = run_cli(*cmd)  # in this process (cli_helpers): the workers are spawned as the command spawns them
    assert rc == 0, stderr[-3000:]
    got = load_file(str(tmp_path / "lp.safetensors"))
    for i in range(len(ROW_IMAGES)):
        n = got[f"logprobs.{i}"].numel()
        assert (got[f"logprobs.{i}"] - ref[i, :n]).abs().max() <= 1e-4, i
    lines[0]["images"] = ["1_0.png"]  # a 56 x 56 image for ids that expand a 112 x 112 one
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rc, _, stderr = run_cli(*cmd)
    assert rc == 2 and "takes 4 <|image_pad|> tokens, its prompt has 16" in stderr, stderr[-2000:]


def test_what_images_do_not_reach_yet_is_one_line(tiny_assets):
    from megappo.config import ConfigError, load_config
    from tests.trainer_utils import REPO

    path = f"model.path={tiny_assets['tiny-qwen2_5_vl']}"
    for extra, says in ((["actor.parallel.cp=2", "actor.parallel.dp=1"], "context parallel does not split images"),
                        (["trainer.mode=async", "resources.rollout_workers=1"], "trainer.mode=async with a vision"),
                        (["rollout.multi_turn.enable=true"], "rollout.multi_turn with a vision")):
        with pytest.raises(ConfigError, match=says):
            load_config(REPO / "configs/grpo_tiny_vl.yaml", [path, *extra])
