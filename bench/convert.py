"""Checkpoint converter benchmark: peak RSS and throughput of `python -m tools.convert_ckpt` both ways.
Prints one JSON object per model:

  params, bytes           parameter count and HF weight bytes
  largest_tensor_bytes    the largest single tensor, HF or megatron (e.g. a fused [gate; up] fc1)
  rss_bound_bytes         2 x largest_tensor_bytes + 1 GB: the converter's promise, whatever the model size
  baseline_rss_bytes      peak RSS of a process that only imports the converter (torch + transformers)
  hf_to_mcore, mcore_to_hf  {seconds, MB_per_s, peak_rss_bytes, within_bound}; each conversion runs as its own
                          subprocess (started by a small fresh python), peak RSS = os.wait4's ru_maxrss of it
  bit_exact               HF -> mcore -> HF gave identical tensors (names, dtypes, bytes)

    python bench/convert.py                         # SmolLM2-135M (real, bf16), a synthetic ~1B llama (bf16) and
                                                    # an embedding-heavy ~1.2B (1 GB embedding: the bound's scaling)
    python bench/convert.py --models smollm2 --tp 3 --pp 2
    python bench/convert.py --models 1b --workdir /big/disk   # ~6 GB of scratch for the 1B (7 GB for wide)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# ~1.0B llama: GQA (16 heads, 8 KV), untied embeddings, bf16 -> 2.0 GB of safetensors
SYNTH_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
# ~1.2B dominated by a 1 GB embedding (and a 1 GB lm_head): the largest tensor drives the RSS bound
SYNTH_WIDE = dict(hidden_size=4096, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128000, max_position_embeddings=4096)


def make_synthetic(out: Path, shapes: dict, shard_bytes: int = 1 << 30) -> Path:
    """A random llama HF dir written as safetensors shards directly (no transformers model in memory:
    at most one shard of tensors is alive)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    if (out / "model.safetensors.index.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = LlamaConfig(**shapes, tie_word_embeddings=False, rms_norm_eps=1e-5, dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp)
    h, f, hd = shapes["hidden_size"], shapes["intermediate_size"], shapes["hidden_size"] // shapes["num_attention_heads"]
    kv = shapes["num_key_value_heads"] * hd
    names = [("model.embed_tokens.weight", (shapes["vocab_size"], h))]
    for i in range(shapes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                  (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                  (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                  (p + "mlp.down_proj.weight", (h, f))]
    names += [("model.norm.weight", (h,)), ("lm_head.weight", (shapes["vocab_size"], h))]
    gen = torch.Generator().manual_seed(0)
    shards, cur, size = [], {}, 0
    for name, shape in names:
        t = (torch.randn(shape, generator=gen) * (0.02 if len(shape) > 1 else 1.0)).to(torch.bfloat16)
        cur[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            shards.append(cur)
            save_file(cur, str(tmp / f"part{len(shards)}.safetensors"), metadata={"format": "pt"})
            cur, size = {}, 0
    if cur:
        shards.append(cur)
        save_file(cur, str(tmp / f"part{len(shards)}.safetensors"), metadata={"format": "pt"})
    n = len(shards)
    weight_map, total = {}, 0
    for i in range(n):
        src = tmp / f"part{i + 1}.safetensors"
        dst = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        src.rename(tmp / dst)
        for name, shape in names:
            if name in shards[i]:
                weight_map[name] = dst
                total += math.prod(shape) * 2
    del shards, cur
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# A forked child's ru_maxrss starts at its parent's peak (Linux carries the pre-exec mm's high-water
# mark across exec), and this script's own RSS is large after building the synthetic model. So a
# small, fresh python (no torch) starts the conversion and reports that child's own ru_maxrss.
_WRAPPER = """
import json, os, subprocess, sys, time
t0 = time.monotonic()
p = subprocess.Popen(sys.argv[2:])
_, status, ru = os.wait4(p.pid, 0)
p.returncode = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as f:
    json.dump({"rc": p.returncode, "seconds": time.monotonic() - t0, "maxrss": ru.ru_maxrss * 1024}, f)
"""


def run_measured(cmd: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of exactly that process, its stdout)."""
    with tempfile.TemporaryDirectory() as td:
        rep = Path(td) / "rusage.json"
        proc = subprocess.run([sys.executable, "-S", "-c", _WRAPPER, str(rep)] + cmd, cwd=REPO,
                              capture_output=True, text=True)
        r = json.loads(rep.read_text()) if rep.exists() else {"rc": proc.returncode}
    if proc.returncode != 0 or r["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return r["seconds"], r["maxrss"], proc.stdout


def tensor_stats(hf_dir: Path) -> tuple[int, int, int]:
    """(params, bytes, largest tensor bytes incl. the fused megatron fc1 / qkv of a layer)."""
    from tools.convert_ckpt.safetensors_io import SafetensorsDir

    st = SafetensorsDir(hf_dir)
    params = sum(math.prod(i.shape) for i in st.tensors.values())
    nbytes = sum(i.nbytes for i in st.tensors.values())
    largest = max(i.nbytes for i in st.tensors.values())
    for name, i in st.tensors.items():
        if name.endswith("gate_proj.weight"):
            largest = max(largest, 2 * i.nbytes)
        if name.endswith("q_proj.weight"):
            k = st.info(name.replace("q_proj", "k_proj")).nbytes
            largest = max(largest, i.nbytes + 2 * k)
    return params, nbytes, largest


def bit_exact(a: Path, b: Path) -> bool:
    import torch

    from tools.convert_ckpt.safetensors_io import SafetensorsDir

    sa, sb = SafetensorsDir(a), SafetensorsDir(b)
    if set(sa.keys()) != set(sb.keys()):
        return False
    for name in sa.keys():
        x, y = sa.get(name), sb.get(name)
        if x.dtype != y.dtype or not torch.equal(x, y):
            return False
    return True


def bench_model(name: str, hf_dir: Path, work: Path, tp: int, pp: int) -> dict:
    params, nbytes, largest = tensor_stats(hf_dir)
    bound = 2 * largest + 10**9
    py = sys.executable
    _, base_rss, _ = run_measured([py, "-c", "import tools.convert_ckpt.core, transformers, tqdm; "
                                             "from transformers import AutoConfig"])
    mc, hf = work / f"{name}-mcore", work / f"{name}-hf"
    res = {"model": name, "params": params, "bytes": nbytes, "largest_tensor_bytes": largest, "rss_bound_bytes": bound,
           "baseline_rss_bytes": base_rss, "layout": f"TP{tp}xPP{pp}"}
    for direction, cmd in (
            ("hf_to_mcore", [py, "-m", "tools.convert_ckpt", "hf-to-mcore", "--hf", str(hf_dir), "--out", str(mc),
                             "--tp", str(tp), "--pp", str(pp), "--overwrite", "--quiet"]),
            ("mcore_to_hf", [py, "-m", "tools.convert_ckpt", "mcore-to-hf", "--ckpt", str(mc), "--out", str(hf),
                             "--overwrite", "--quiet"])):
        dt, rss, out = run_measured(cmd)
        inner = json.loads(out.strip().splitlines()[-1])["seconds"]
        res[direction] = {"seconds": round(dt, 2), "convert_seconds": inner, "MB_per_s": round(nbytes / 1e6 / inner, 1),
                          "peak_rss_bytes": rss, "within_bound": rss <= bound}
    res["bit_exact"] = bit_exact(hf_dir, hf)
    shutil.rmtree(mc, ignore_errors=True)
    shutil.rmtree(hf, ignore_errors=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2,1b,wide", help="comma list of: smollm2, 1b, wide")
    p.add_argument("--workdir", default=None, help="scratch dir (default: a temp dir; the 1B needs ~6 GB)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic 1B HF dir in --workdir for next time")
    p.add_argument("--tp", type=int, default=None, help="layout to convert for (default: TP2xPP2; SmolLM2: TP3xPP2)")
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for m in args.models.split(","):
            if m == "smollm2":
                from tools.smollm2_to_hf import convert

                src = convert(REPO / "assets" / "smollm2-135m-instruct")
                print(json.dumps(bench_model("smollm2-135m", src, work, args.tp or 3, args.pp)), flush=True)
            elif m in ("1b", "wide"):
                name, shapes = ("synthetic-1b", SYNTH_1B) if m == "1b" else ("synthetic-wide-1.2b", SYNTH_WIDE)
                src = make_synthetic(work / f"{name}-hf", shapes)
                print(json.dumps(bench_model(name, src, work, args.tp or 2, args.pp)), flush=True)
                if not args.keep:
                    shutil.rmtree(src, ignore_errors=True)
            else:
                raise SystemExit(f"unknown model {m!r}: choose smollm2, 1b, wide")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
