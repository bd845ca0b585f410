"""`megappo logprobs`: score token rows with a model sharded over local processes (audit a checkpoint).

    megappo logprobs --model DIR --tp T --pp P [--vpp V] [--dp D] [--cp C] --input tokens.jsonl \\
        --out logprobs.safetensors [--critic] [--temperature 1.0] [--micro-batch-size 1]

Spawns T*C*P*D local processes (gloo on CPU, nccl on GPU; --cp: each row's tokens split over C context-parallel
ranks), builds the megatron model from DIR (a HuggingFace model dir, or a megatron dist checkpoint dir holding the
HF config.json), and writes one tensor per input row to --out (safetensors): `logprobs.{i}` (or `values.{i}` with
--critic) of length len(input_ids) - response_start, where `logprobs.{i}[j]` = log p(input_ids[k+j] | input_ids[:k+j])
(k = response_start) and `values.{i}[j]` is the critic's value of the state before that token.
Input: JSON lines {"input_ids": [...], "response_start": k} with 1 <= k < len(input_ids). A vision-language model's
row may carry "images": paths (relative to the input file's directory) of the images its prompt shows, in order; its
input_ids then hold each image as the model's HF processor expands it (<|vision_start|>, n x <|image_pad|>,
<|vision_end|>), before response_start.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from megappo.parallel.layout import LAYOUT_KEYS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model dir, or megatron dist checkpoint dir with config.json")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (interleaved)")
    parser.add_argument("--dp", type=int, default=1, help="data parallel size")
    parser.add_argument("--cp", type=int, default=1,
                        help="context parallel size: each row's tokens split over cp ranks (long rows)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert parallel size (mixture-of-experts models; must divide --dp x --cp and the "
                             "expert count)")
    parser.add_argument("--input", required=True, help='JSON lines: {"input_ids": [...], "response_start": k}')
    parser.add_argument("--out", required=True, help="output .safetensors")
    parser.add_argument("--critic", action="store_true", help="score values with a value head instead of log-probs")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234, help="value-head init seed when DIR has no `score` weights")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the model runs (auto: cuda when a GPU is visible)")


def read_rows(path) -> list[dict]:
    from megappo.data.images import IMAGES, read_images

    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        ids, k = row.get("input_ids"), row.get("response_start")
        if not isinstance(ids, list) or not isinstance(k, int) or not 1 <= k < len(ids):
            raise ValueError(f"{path}:{n}: need input_ids (list) and 1 <= response_start < len(input_ids)")
        rows.append({"input_ids": ids, "response_start": k})
        if row.get(IMAGES):
            rows[-1][IMAGES] = read_images(row[IMAGES], Path(path).parent, f"{path}:{n}")
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def build_batch(rows: list[dict], pad_id: int = 0):
    """Left-pad every row to the longest; all rows end at the last column."""
    from megappo.data.dataset import left_pad

    ids, mask = left_pad([r["input_ids"] for r in rows], pad_id)
    resp = max(len(r["input_ids"]) - r["response_start"] for r in rows)
    return ids, mask, resp


def _worker(rank, world, port, args_dict, rows, images):
    from megappo.parallel.megatron_init import destroy, init_distributed, init_megatron, resolve_device
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine

    layout = args_dict["layout"]
    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(layout, seed=args_dict["seed"])
    from megatron.core import parallel_state as mpu

    engine = MegatronEngine(args_dict["model"], layout, EngineConfig(
        device=resolve_device(args_dict["device"]), head="value" if args_dict["critic"] else "lm",
        seed=args_dict["seed"]))
    dp_rank = mpu.get_data_parallel_rank()
    mbs = args_dict["micro_batch_size"]
    # equal shards per DP rank, padded with copies of row 0 to a multiple of mbs (and of pp micro-batches
    # for the interleaved schedule); padded rows are dropped by the parent
    per_unit = mbs * (layout.pp if layout.virtual_pp else 1)
    per_rank = -(-len(rows) // layout.dp)
    per_rank = -(-per_rank // per_unit) * per_unit
    order = list(range(len(rows))) + [0] * (per_rank * layout.dp - len(rows))
    ids, mask, resp = build_batch([rows[i] for i in order])
    sl = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    batch = {"input_ids": ids, "attention_mask": mask, **{k: v[order] for k, v in images.items()}}
    out = engine.forward_only({k: v[sl] for k, v in batch.items()}, response_length=resp,
                              micro_batch_size=mbs, temperature=args_dict["temperature"], compute_entropy=False)
    result = None
    if out is not None and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0:
        key = "values" if args_dict["critic"] else "logprobs"
        result = {"start": dp_rank * per_rank, key: out[key].float().cpu().contiguous()}
    destroy()
    return result


def image_batch(rows: list[dict], model) -> dict:
    """The rows' images as the engine takes them (pixel_values, image_grid_thw: data/images.pixel_batch), {} when no
    row has any; ValueError, one line, for images given to a text model or ids that do not expand them."""
    from megappo.data.images import IMAGES, pixel_batch, processor_for

    if not any(r.get(IMAGES) for r in rows):
        return {}
    processor = processor_for(model)
    if processor is None:
        raise ValueError(f"rows carry images but --model {model} is a text model (or its dir lacks the processor "
                         "files: processor_config.json / preprocessor_config.json): score them with a vision-language "
                         "model's dir")
    out = pixel_batch([r.get(IMAGES, []) for r in rows], processor.image_processor)
    from megappo.models.vision import mrope_positions

    ids, mask, resp = build_batch(rows)
    mrope_positions(ids, mask, out["image_grid_thw"], processor.image_token_id, processor.image_processor.merge_size,
                    prompt_end=ids.shape[1] - resp)  # raises where a row's ids do not expand its images
    return out


def score(args, rows: Optional[list] = None, images: Optional[dict] = None) -> dict:
    """Run the scoring workers; returns {f"{key}.{i}": tensor} for every input row (`rows` / `images`: read_rows /
    image_batch of args.input, when the caller has them already)."""
    from megappo.parallel.launch import spawn_local

    if rows is None:
        rows = read_rows(args.input)
        images = image_batch(rows, args.model)
    args_dict = {k: getattr(args, k) for k in ("model", "critic", "temperature", "micro_batch_size", "seed")}
    args_dict.update(layout=layout_of(args), device=getattr(args, "device", "auto"))
    results = spawn_local(_worker, args_dict["layout"].world_size, args_dict, rows, images or {})
    key = "values" if args.critic else "logprobs"
    tensors = {}
    for res in results:
        if res is None:
            continue
        for j in range(res[key].shape[0]):
            i = res["start"] + j
            if i >= len(rows):
                break
            n = len(rows[i]["input_ids"]) - rows[i]["response_start"]
            tensors[f"{key}.{i}"] = res[key][j, res[key].shape[1] - n:].clone()
    missing = [i for i in range(len(rows)) if f"{key}.{i}" not in tensors]
    if missing:
        raise RuntimeError(f"no result for rows {missing[:10]}")
    return tensors


def layout_of(args):
    """The ParallelLayout of the command's --tp/--pp/--vpp/--dp/--ep/--cp (ValueError, one line, when it is none)."""
    from megappo.parallel.layout import ParallelLayout

    return ParallelLayout(**{k: getattr(args, k, None if k == "vpp" else 1) for k in LAYOUT_KEYS})


def check_model(model, layout) -> None:
    """Before any worker starts: a config.json of a family megappo maps, that `layout` can split; ValueError."""
    import json

    from megappo.parallel.weight_mapping import ModelDims

    config = Path(model) / "config.json"
    if not config.is_file():
        raise ValueError(f"--model {model} has no config.json: pass a HF model dir or a role's megatron checkpoint "
                         "(checkpoints/step_N/actor)")
    dims = ModelDims.from_hf_dict(json.loads(config.read_text()), tp=layout.tp)
    layout.validate(dims.num_heads, dims.num_kv_heads, dims.num_layers, num_experts=dims.num_experts)


def main(args: argparse.Namespace) -> int:
    try:
        check_model(args.model, layout_of(args))
        rows = read_rows(args.input)
        images = image_batch(rows, args.model)  # a row's images against its ids, before any worker starts
    except ValueError as e:
        print(f"megappo logprobs: {e}", file=sys.stderr)
        return 2
    from safetensors.torch import save_file

    tensors = score(args, rows, images)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out, metadata={"model": str(args.model), "rows": str(len(tensors))})
    print(f"wrote {len(tensors)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="megappo logprobs")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
