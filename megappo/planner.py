"""Layout / memory planner: per-GPU memory of every role of a colocated PPO job, phase by phase.

`megappo plan --config configs/ppo_70b.yaml [--nodes N --gpus-per-node G --gpu-mem-gb M] [--json]`; `--max-len`: the
longest sample that fits the layout; `--seq-len N` plans N-token samples (with `--smallest`: the pool and cp for them)

What each role and phase holds, and why, is memory_model.py's (its docstring states the model);
this module searches layouts with it (suggest, smallest, max_len) and prints its plan."""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys

from omegaconf import OmegaConf

from megappo.config import ConfigError, load_config
from megappo.config.schema import MegappoConfig
from megappo.config.validate import max_positions, validate_config
from megappo.memory_model import GB, HEADROOM, ROLES, layout_str, plan
from megappo.vision_memory import image_tokens


def with_pool(cfg, nodes: int | None, gpus_per_node: int | None, gpu_mem_gb: float | None):
    """Apply --nodes/--gpus-per-node/--gpu-mem-gb, refilling each role's dp to the new pool."""
    cfg = copy.deepcopy(cfg)
    if nodes:
        cfg.resources.nodes = nodes
    if gpus_per_node:
        cfg.resources.workers_per_node = gpus_per_node
    if gpu_mem_gb:
        cfg.resources.gpu_memory_gb = gpu_mem_gb
    world = cfg.resources.nodes * cfg.resources.workers_per_node
    for r in ROLES + (("teacher",) if cfg.teacher.model and not cfg.resources.teacher_workers else ()):
        par = cfg[r].parallel
        if world % (par.tp * par.cp * par.pp):
            what = ("tp*cp*pp", "tp/cp/pp") if par.cp > 1 else ("tp*pp", "tp/pp")
            raise ConfigError(f"{r}.parallel {what[0]} = {par.tp * par.cp * par.pp} does not divide the {world} GPUs; "
                              f"change {what[1]} or the node count")
        par.dp = world // (par.tp * par.cp * par.pp)
    return cfg


def _with_cp(cfg, cp: int):
    """cfg with every trained / frozen role (the pool's) at context parallel `cp`, dp refilling the pool."""
    cfg = copy.deepcopy(cfg)
    for r in ROLES:
        cfg[r].parallel.cp = cp
    return with_pool(cfg, None, None, None)


def larger_cps(cfg) -> tuple[int, ...]:
    """The actor's cp, then its doublings that divide the pool (context parallel for a longer sample)."""
    world = cfg.resources.nodes * cfg.resources.workers_per_node
    cp = cfg.actor.parallel.cp
    return tuple(cp * 2**k for k in range(8) if world % (cp * 2**k) == 0)


def suggest(cfg, cps: tuple[int, ...] | None = None) -> dict | None:
    """The nearest layout (fewest doublings/halvings of tp and pp, offload tried last) that fits, at the config's cp,
    else at each of `cps` in turn (default larger_cps: fewer tokens and a smaller CP mask per rank; dp * cp, which
    shards the optimizer, stays world / (tp * pp))."""
    world = cfg.resources.nodes * cfg.resources.workers_per_node
    a = cfg.model.arch
    tps = [t for t in (1, 2, 4, 8) if t <= cfg.resources.workers_per_node
           and a.num_attention_heads % t == 0 and a.num_kv_heads % t == 0]
    pps = [p for p in range(1, a.num_layers + 1) if a.num_layers % p == 0 and world % p == 0 and p <= 16]
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if not a.num_experts and e == 1
           or a.num_experts and a.num_experts % e == 0 and e <= world]
    p0 = cfg.actor.parallel
    for cp in (larger_cps(cfg) if cps is None else cps):
        candidates = []
        for tp, pp, ep, off in itertools.product(tps, pps, eps, (False, True)):
            if world % (tp * cp * pp) or (world // (tp * pp)) % ep:  # validate_config has the ep rule
                continue
            cost = abs(math.log2(tp / p0.tp)) + abs(math.log2(pp / p0.pp)) + abs(math.log2(ep / p0.ep)) + \
                (4 if off else 0)
            candidates.append((cost, tp, pp, ep, off))
        for _, tp, pp, ep, off in sorted(candidates):
            c = OmegaConf.create(OmegaConf.to_container(cfg))
            dp = world // (tp * cp * pp)
            for r in ROLES:
                c[r].parallel.tp, c[r].parallel.pp, c[r].parallel.vpp, c[r].parallel.ep = tp, pp, None, ep
                c[r].parallel.cp, c[r].parallel.dp = cp, dp
                c[r].offload = off or bool(cfg[r].offload)
            try:
                validate_config(OmegaConf.merge(OmegaConf.structured(MegappoConfig), c))
            except ConfigError:
                continue
            result = plan(c)
            if result["fits"]:
                return {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "offload": off or None,
                        "peak_gpu_gb": result["peak_gpu_gb"]} | ({"cp": cp} if cp > 1 else {})
    return None


def smallest(cfg, max_nodes: int = 64, cps: tuple[int, ...] | None = None) -> dict | None:
    """The fewest nodes (of resources.workers_per_node GPUs) on which the config's layout, refilled with dp,
    or else suggest()'s nearest layout fits: {"nodes", "gpus", "tp", "pp", "dp", "ep", "offload", "peak_gpu_gb"}
    (and "cp" where > 1). `cps` (a long sample's search, --smallest --seq-len: the context-parallel sizes to try):
    the config's tp / pp / ep at the first of them that fits, on the fewest nodes; only where that fits on no pool,
    suggest()'s search at each of them. None: the config's cp only."""
    cp0 = cfg.actor.parallel.cp

    def own_layout(nodes: int, cp: int):
        at = copy.deepcopy(cfg)
        at.resources.nodes = nodes
        try:
            c = with_pool(at, None, None, None) if cp == cp0 else _with_cp(at, cp)
            validate_config(c)
        except ConfigError:
            return at, None
        result = plan(c)
        if not result["fits"]:
            return c, None
        p = c.actor.parallel
        return c, {"nodes": nodes, "gpus": nodes * cfg.resources.workers_per_node, "tp": p.tp, "pp": p.pp,
                   "dp": p.dp, "ep": p.ep, "offload": bool(c.actor.offload) or None,
                   "peak_gpu_gb": result["peak_gpu_gb"]} | ({"cp": cp} if cp > 1 else {})

    if cps:
        for nodes, cp in itertools.product(range(1, max_nodes + 1), cps):
            found = own_layout(nodes, cp)[1]
            if found:
                return found
    for nodes in range(1, max_nodes + 1):
        c, found = own_layout(nodes, cp0)
        if not found:
            world = nodes * cfg.resources.workers_per_node
            found = suggest(c, tuple(cp for cp in (cps or (cp0,)) if world % cp == 0))
            if found:
                found = {"nodes": nodes, "gpus": world, **found}
        if found:
            return found
    return None


def with_length(cfg, tokens: int, one_row: bool = False):
    """cfg with samples of `tokens` (prompt + response: the prompt as configured, the response the rest); `one_row`:
    one row per micro-batch in every Megatron role (a long sample's packing)."""
    cfg = copy.deepcopy(cfg)
    cfg.rollout.max_new_tokens = tokens - cfg.data.max_prompt_length
    if one_row:
        for r in ("actor", "critic"):
            cfg[r].micro_batch_size = 1
        for r in ("actor", "ref", "teacher"):
            if "log_prob_micro_batch_size" in cfg[r]:
                cfg[r].log_prob_micro_batch_size = 1
    return cfg


def max_len(cfg) -> dict:
    """The longest sample (prompt + response tokens, one row per micro-batch) that fits the GPU at the config's
    layout: a binary search over the response length with plan() (the memory grows with it), up to the model's
    positions. {"tokens", "prompt", "response", "peak_gpu_gb", "peak_phase", "bound": memory | positions, "layout"}
    ({"tokens": 0, ...} where even a one-token response does not fit)."""
    lo, hi = cfg.data.max_prompt_length, max_positions(cfg)  # plan(lo) "fits" by convention; lo + 1 is the shortest
    if not plan(with_length(cfg, lo + 1, True))["fits"]:
        lo = 0
    elif plan(with_length(cfg, hi, True))["fits"]:
        lo = hi
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if plan(with_length(cfg, mid, True))["fits"] else (lo, mid)
    best = plan(with_length(cfg, max(lo, cfg.data.max_prompt_length + 1), True))
    return {"tokens": lo, "prompt": cfg.data.max_prompt_length, "response": max(0, lo - cfg.data.max_prompt_length),
            "peak_gpu_gb": best["peak_gpu_gb"], "peak_phase": best["peak_phase"],
            "bound": "positions" if lo == max_positions(cfg) else "memory", "layout": best["layout"]["actor"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int, help="override resources.nodes (dp refills the pool)")
    parser.add_argument("--gpus-per-node", type=int, help="override resources.workers_per_node")
    parser.add_argument("--gpu-mem-gb", type=float, help="override resources.gpu_memory_gb")
    parser.add_argument("--host-mem-gb", type=float, help="host RAM per node: refuse when the pinned host copies "
                        "(offloaded roles, vLLM's sleeping weights with sleep_level 1) would not fit in 90%% of it "
                        "(the sbatch passes the job's memory limit per node)")
    parser.add_argument("--smallest", action="store_true", help="print the fewest nodes (and the layout) on which "
                        "the config fits, instead of planning its own pool")
    parser.add_argument("--seq-len", type=int, help="plan samples of this many tokens (prompt + response: the "
                        "response is the rest after data.max_prompt_length); with --smallest, the context parallel "
                        "size (powers of two) is chosen too, so that the sample fits")
    parser.add_argument("--max-len", action="store_true", help="print the longest sample (prompt + response "
                        "tokens, one row per micro-batch) that fits the GPU at the config's layout")
    parser.add_argument("--json", action="store_true", help="print one JSON object (peak_gpu_gb, per-role breakdown)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.parallel.tp=4")


def main(args: argparse.Namespace) -> int:
    seq_len = getattr(args, "seq_len", None)
    try:
        if getattr(args, "max_len", False) and (getattr(args, "smallest", False) or seq_len):
            raise ConfigError("--max-len finds the length at the config's layout: drop --smallest / --seq-len "
                              "(--smallest --seq-len N finds the pool and cp for N tokens)")
        cfg = load_config(args.config, args.overrides, validate=False)
        cfg = with_pool(cfg, args.nodes, args.gpus_per_node or None, args.gpu_mem_gb)
        if seq_len is not None:
            prompt, positions = cfg.data.max_prompt_length, max_positions(cfg)
            if not prompt < seq_len <= positions:
                raise ConfigError(f"--seq-len {seq_len} must be above data.max_prompt_length={prompt} (the prompt) "
                                  f"and at most the model's {positions} positions; pick a length in between")
            cfg = with_length(cfg, seq_len)
        validate_config(cfg)
        image_tokens(cfg)  # data.max_image_tokens' range, in one line
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    if getattr(args, "max_len", False):
        return _print_max_len(cfg, args.json)
    if getattr(args, "smallest", False):
        found = smallest(cfg, cps=tuple(cfg.actor.parallel.cp * 2**k for k in range(8)) if seq_len else None)
        print(json.dumps(found) if args.json or not found else
              f"smallest pool: {found['nodes']} node(s) x {cfg.resources.workers_per_node} GPUs, actor "
              f"{_found_layout(found)}" + (" offloaded" if found["offload"] else "") +
              f", peak {found['peak_gpu_gb']:.1f} GB" + (f" at {seq_len:,} tokens" if seq_len else ""))
        if not found and seq_len:
            m = max_len(cfg)
            print(f"no pool of up to 64 nodes fits a {seq_len:,}-token sample; at the config's layout "
                  f"({m['layout']}) the longest that fits is {m['tokens']:,} tokens; raise actor.parallel.cp or tp "
                  "(or the GPU memory), or shorten the sample", file=sys.stderr)
        return 0 if found else 1
    result = plan(cfg)
    if not result["fits"]:
        result["suggestion"] = suggest(cfg)
    host_msg = None
    host = getattr(args, "host_mem_gb", None)
    if host:
        result["host_mem_gb"] = host
        result["host_fits"] = result["host_gb_per_node"] <= 0.9 * host
        if not result["host_fits"]:
            host_msg = (f"offloaded roles, vLLM's sleeping weights and a checkpoint's snapshot need "
                        f"{result['host_gb_per_node']:.0f} GB of "
                        f"pinned host memory per node but the node has {host:.0f} GB (90% usable); offload fewer "
                        f"roles, set rollout.sleep_level=2, or add nodes (more dp shards the optimizer states)")
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    if not result["fits"]:
        print(refusal(result), file=sys.stderr)
        return 1
    if host_msg:
        print(host_msg, file=sys.stderr)
        return 1
    return 0


def _found_layout(found: dict) -> str:
    return layout_str(argparse.Namespace(tp=found["tp"], cp=found.get("cp", 1), pp=found["pp"], vpp=None,
                                          dp=found["dp"], ep=found["ep"]))


def _print_max_len(cfg, as_json: bool) -> int:
    m = max_len(cfg)
    if as_json:
        print(json.dumps(m))
    if not m["tokens"]:
        print(f"not even a {cfg.data.max_prompt_length + 1}-token sample fits at {m['layout']} (the prompt is "
              f"data.max_prompt_length={cfg.data.max_prompt_length}); raise actor.parallel.cp or tp, or add nodes "
              "(more dp shards the optimizer states)", file=sys.stderr)
        return 1
    if not as_json:
        bound = "the model's positions bound it" if m["bound"] == "positions" else "bound by GPU memory"
        print(f"longest sample at {m['layout']}: {m['tokens']:,} tokens (prompt {m['prompt']:,} + response "
              f"{m['response']:,}, one row per micro-batch), peak {m['peak_gpu_gb']:.1f} GB ({m['peak_phase']}); "
              f"{bound}")
    return 0


def refusal(result: dict) -> str:
    t = result.get("teacher_pool")
    if t and not t["fits"] and result["peak_gpu_gb"] <= result["usable_gpu_gb"]:
        return (f"the teacher does not fit its pool: {t['peak_gpu_gb']:.1f} GiB per GPU at {t['layout']} but "
                f"{result['usable_gpu_gb']:g} GiB are usable; raise teacher.parallel.tp or pp (and "
                "resources.teacher_workers)")
    phase = result["peak_phase"]
    msg = (f"layout does not fit: the {phase} phase needs {result['peak_gpu_gb']:.1f} GiB per GPU but the GPU has "
           f"{result['gpu_mem_gb']:g} GiB, {result['usable_gpu_gb']:g} of them usable ({HEADROOM:.0%} kept free)")
    vllm = result["roles"]["rollout"]
    if vllm["vllm_gb"] <= vllm["weights_gb"]:
        msg += "; vLLM's share is smaller than its weights (raise rollout.tp or rollout.gpu_memory_utilization)"
    s = result.get("suggestion")
    if s:
        off = " with actor/critic/ref offload=true" if s["offload"] else ""
        ep = f" ep={s['ep']}" if s.get("ep", 1) > 1 else ""
        cp = f" cp={s['cp']}" if s.get("cp", 1) > 1 else ""
        msg += (f"; nearest layout that fits: tp={s['tp']}{cp} pp={s['pp']} dp={s['dp']}{ep}{off} "
                f"({s['peak_gpu_gb']:.1f} GB)")
    else:
        msg += "; no layout of this pool fits: add nodes"
    return msg


def render(result: dict) -> str:
    lines = [f"{result['total_params_b']}B params on {result['gpus']} GPUs x {result['gpu_mem_gb']:g} GiB; "
             f"layouts: " + ", ".join(f"{k} {v}" for k, v in result["layout"].items())]
    lines.append(f"{'role':8} {'params/GPU':>11} {'experts':>9} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8}"
                 "  offload")
    for r, m in result["roles"].items():
        if r == "rollout":
            continue
        lines.append(f"{r:8} {m['params_per_gpu_m']:>10.1f}M {m['expert_params_per_gpu_m']:>8.1f}M "
                     f"{m['weights_gb']:>7.2f}G {m['grads_gb']:>7.2f}G "
                     f"{m['optimizer_gb']:>7.2f}G {m['activations_gb']:>7.2f}G  {m['offload']}"
                     f" (frees {m['freed_by_offload_gb']:.1f}G)")
    v = result["roles"]["rollout"]
    lines.append(f"vLLM     {v['vllm_gb']:.2f}G (weights {v['weights_gb']:.2f}G + KV/workspace "
                 f"{v['kv_cache_and_workspace_gb']:.2f}G), sleeps outside rollout: {v['sleeps_outside_rollout']}")
    lines.append(f"vLLM KV cache: {v['kv_cache_bytes_per_token'] / 1024:.1f} KiB per token per GPU, room for "
                 f"{v['kv_cache_tokens']:,} tokens; a step's samples need {v['kv_cache_tokens_needed']:,} per engine"
                 + ("" if v["kv_cache_tokens"] >= v["kv_cache_tokens_needed"] else " (vLLM queues the rest)"))
    for r, m in result["roles"].items():
        if m.get("cp_kv_gb_per_layer") or m.get("cp_mask_gb_per_layer"):
            lines.append(f"{r} context parallel: {m['tokens_per_gpu']:,} of the {result['sample_tokens']:,}-token "
                         f"sample's tokens per GPU at {m['activation_bytes_per_token']:,} B per token per layer; "
                         f"per layer gathered K/V {m['cp_kv_gb_per_layer']:.2f}G + SDPA's mask "
                         f"{m['cp_mask_gb_per_layer']:.2f}G, the bool mask {m['cp_masks_gb']:.2f}G")
    for r, m in result["roles"].items():
        if m.get("vision_params_m"):
            lines.append(f"{r} vision tower: {m['vision_params_m']:.1f}M params on the first stage, whole on each TP "
                         "rank, " + ("trained" if m["vision_trained"] else "frozen (weights only)") +
                         (f"; activations {m['vision_activations_gb']:.2f}G for {m['image_patches_per_micro_batch']:,} "
                          "image patches per micro-batch" if "vision_activations_gb" in m else ""))
    lines.append("phases (GB/GPU incl. overhead): " + ", ".join(f"{k} {g:.1f}" for k, g in result["phases_gb"].items()))
    ws = result["weight_sync"]
    experts = f"; every one of {ws['experts_per_rollout_gpu']} (layer, expert) pairs, TP-sliced" \
        if ws.get("experts_per_rollout_gpu") else ""
    what = " (LoRA adapters only, rollout.lora_sync=adapter)" if ws["sends"] == "adapters" else ""
    lines.append(f"weight sync per step{what}: {ws['bytes_per_gpu'] / GB:.3f} GB into each rollout GPU, "
                 f"{ws['bytes_total'] / GB:.1f} GB in all ({ws['replicas']} vLLM replicas){experts}")
    if result["host_gb_per_node"]:
        lines.append(f"pinned host memory: offloaded roles {result['host_offload_gb_per_gpu']:.1f} GB + vLLM asleep "
                     f"{result['host_vllm_sleep_gb_per_gpu']:.1f} GB + checkpoint snapshot "
                     f"{result['host_save_snapshot_gb_per_gpu']:.1f} GB per GPU, {result['host_gb_per_node']:.0f} GB per node")
    t = result.get("teacher_pool")
    if t:
        lines.append(f"teacher pool: {t['gpus']} GPUs at {t['layout']}, {t['params_per_gpu_m']:.1f}M params/GPU, "
                     f"peak {t['peak_gpu_gb']:.1f} GB: " + ("fits" if t["fits"] else "DOES NOT FIT"))
    lines.append(f"peak {result['peak_gpu_gb']:.1f} GB ({result['peak_phase']}): " + ("fits" if result["fits"] else "DOES NOT FIT"))
    return "\n".join(lines)
