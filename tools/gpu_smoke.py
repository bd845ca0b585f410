"""The Megatron side on a GPU, with torch + megatron-core only (no vLLM, no Ray): a smoke test that fits a
machine where only small wheels can be carried in (a lent GPU box with torch and no package registry).

    python tools/gpu_smoke.py [--device cuda] [--dtype bf16] [--out DIR] [--json]

One process, one device. Each check is a row of a pass/fail table (exit 1 when any fails):
- stack:            torch / CUDA / megatron-core / Transformer Engine as this interpreter sees them;
- logprobs vs HF:   the tiny llama actor (megatron, local layer spec) against HF transformers on the same
                    device and dtype (fp32: max |diff| <= 1e-4; bf16: mean |diff| <= 0.05);
- train step:       one Adam step on the device against the same step in fp32 on the CPU: the update's
                    cosine similarity (bf16: >= 0.9; fp32: the updates equal to 1e-4 relative);
- packed == padded: the packed micro-batch (pack_sequences) against the padded path, same tolerances;
- MoE layer:        the tiny Qwen3-MoE (routed experts, local spec) against HF on the device;
- checkpoint:       save (megatron dist checkpoint, optimizer included), load into a fresh engine: the
                    parameters bit for bit, and one more step equal on both;
- LoRA:             actor.lora: two steps move the adapters only (the base bit-identical), and the
                    exported peft adapter on HF's base gives the engine's log-probs;
- expert LoRA:      the same with actor.lora.experts on the tiny Mixtral (an adapter per routed expert);
- offloaded LoRA sync: actor.offload + LoRA: the merged weight sync built while the weights are off the device
                    sends what a resident actor sends, bit for bit, and leaves no merged copy on the device.
`--device cpu` runs the same checks on the CPU (tests/test_gpu_paths.py does, with vllm and ray blocked).

What to carry to a GPU image that has torch, transformers, peft and their usual dependencies but no
registry: megatron-core, omegaconf and antlr4-python3-runtime as wheels (`scripts/gpu_smoke_wheels.sh`
fetches them), and this checkout. megappo needs none of vLLM, Ray or pyarrow for these checks
(tests/test_gpu_paths.py runs them on the CPU with those and the other packages the image lacks blocked).
Runs on a GPU (2026-11-26, two leases of an H200, torch 2.11.0+cu130, no Transformer Engine; the expert-LoRA
row in the second; the offloaded-LoRA-sync row in a fifth, 2026-11-27): every row passed in bf16 and fp32
(docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

B, S, R = 4, 24, 8  # rows, sequence length, response length


def make_batch(vocab: int = 1000) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, :9] = 0
    mask[3, -3:] = 0  # right padding inside the response
    return {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(B, R, generator=g),
            "response_mask": mask[:, -R:].float()}


def pg_loss(out, mb):
    m = mb["response_mask"]
    return -(out["logprobs"] * mb["advantages"] * m).sum(), {"tokens": m.sum()}


def hf_logprobs(path: str, batch: dict, device: str, dtype, adapter: str | None = None) -> torch.Tensor:
    """Log-probs of each row's response tokens by HF transformers (with a peft `adapter` dir on top when
    given), each row unpadded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model = model.to(device).eval()
    out = torch.zeros(B, R)
    with torch.no_grad():
        for b in range(B):
            keep = batch["attention_mask"][b].bool()
            row = batch["input_ids"][b][keep][None].to(device)
            logsm = torch.log_softmax(model(row).logits[0].float(), -1).cpu()
            full = torch.zeros(S)
            pos = keep.nonzero()[:, 0]
            full[pos[1:]] = logsm[:-1].gather(-1, row[0, 1:, None].cpu())[:, 0]
            out[b] = full[S - R:]
    return out


def valid_positions(batch: dict) -> torch.Tensor:
    m = batch["attention_mask"]
    return m[:, S - R:].bool() & (m.cumsum(1)[:, S - R:] > 1)


def close(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor, bf16: bool) -> tuple[bool, str]:
    d = (got.float().cpu() - want.float().cpu())[valid].abs()
    ok = d.mean().item() <= 0.05 if bf16 else d.max().item() <= 1e-4
    return ok, f"|diff| max {d.max().item():.2e} mean {d.mean().item():.2e}"


def engine(path: str, device: str, dtype, train: bool = False, **kw):
    from megappo.config.schema import OptimConfig
    from megappo.parallel.layout import ParallelLayout
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine

    optim = OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0) if train else None
    return MegatronEngine(path, ParallelLayout(), EngineConfig(device=device, params_dtype=dtype, optim=optim, seed=7,
                                                               **kw))


def on_device(batch: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def params(eng) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in eng.named_parameters_global()}


# ---- the checks: each returns (ok, what it measured) ------------------------------------------------------

def check_stack(args, assets) -> tuple[bool, str]:
    import megatron.core

    parts = [f"torch {torch.__version__}", f"megatron-core {megatron.core.__version__}"]
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES, or a CPU build of torch)"
        parts.append(f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    try:
        import transformer_engine  # noqa: F401

        parts.append("transformer-engine importable")
    except Exception:  # noqa: BLE001 - TE is optional here: the local layer spec is used
        parts.append("no transformer-engine (local spec)")
    for mod in ("vllm", "ray"):
        parts.append(f"{mod} {'present' if _importable(mod) else 'absent'}")
    return True, ", ".join(parts)


def _importable(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except Exception:  # noqa: BLE001
        return False


def versus_hf(args, path: str) -> tuple[bool, str]:
    batch = make_batch()
    eng = engine(path, args.device, args.torch_dtype)
    got = eng.forward_only(on_device(batch, args.device), response_length=R, micro_batch_size=2)["logprobs"]
    return close(got, hf_logprobs(path, batch, args.device, args.torch_dtype), valid_positions(batch), args.bf16)


def check_logprobs(args, assets) -> tuple[bool, str]:
    return versus_hf(args, str(assets["tiny-llama"]))


def train_on(eng, batch: dict, device: str) -> None:
    """One Adam step of the policy-gradient loss on `batch` (2 rows per micro-batch)."""
    eng.train_step(on_device(batch, device), pg_loss, float(batch["response_mask"].sum()), response_length=R,
                   micro_batch_size=2)


def update_of_one_step(path: str, batch: dict, device: str, dtype) -> torch.Tensor:
    """Every parameter's change (flattened, name order) after one Adam step on `batch`."""
    eng = engine(path, device, dtype, train=True)
    before = params(eng)
    train_on(eng, batch, device)
    after = params(eng)
    return torch.cat([(after[k] - before[k]).flatten() for k in sorted(before)])


def _cpu_reference_update(rank, world, port, path, batch):
    """In a child process that sees no GPU: megatron's DDP puts its buffers on the current CUDA device when
    there is one, so a CPU engine cannot share a process with a GPU one (the trainer never mixes them)."""
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron

    init_distributed(rank, world, "127.0.0.1", port, backend="gloo")
    init_megatron(ParallelLayout(), seed=7)
    return update_of_one_step(path, batch, "cpu", torch.float32)


def check_train_step(args, assets) -> tuple[bool, str]:
    from megappo.parallel.launch import spawn_local

    path, batch = str(assets["tiny-llama"]), make_batch()
    here = update_of_one_step(path, batch, args.device, args.torch_dtype)
    # inherited by the spawned child only: this process's CUDA is initialised already
    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "", "MEGAPPO_DEVICE": "cpu"}):
        ref = spawn_local(_cpu_reference_update, 1, path, batch, timeout=300)[0]
    cos = torch.nn.functional.cosine_similarity(here, ref, dim=0).item()
    rel = ((here - ref).norm() / ref.norm()).item()
    # fp32: 1e-4 relative. Adam's first step is about lr * g / |g|, so where |g| is near adam_eps a summation
    # order difference in g (cuda vs CPU kernels) shows in the update: 1.7e-5 on an H200 (docs/gpu.md)
    ok = cos >= 0.9 if args.bf16 else rel <= 1e-4
    return ok, f"update vs fp32 CPU: cosine {cos:.4f}, relative diff {rel:.2e}"


def check_packed(args, assets) -> tuple[bool, str]:
    path, batch = str(assets["tiny-llama"]), make_batch()
    outs = []
    for packed in (False, True):
        eng = engine(path, args.device, args.torch_dtype, pack_sequences=packed)
        outs.append(eng.forward_only(on_device(batch, args.device), response_length=R, micro_batch_size=2)["logprobs"])
        del eng
    return close(outs[1], outs[0], valid_positions(batch), args.bf16)


def check_moe(args, assets) -> tuple[bool, str]:
    return versus_hf(args, str(assets["tiny-qwen3_moe"]))


def check_checkpoint(args, assets) -> tuple[bool, str]:
    path, batch = str(assets["tiny-llama"]), make_batch()
    step = lambda e: train_on(e, batch, args.device)  # noqa: E731
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        a = engine(path, args.device, args.torch_dtype, train=True)
        step(a)
        a.save_checkpoint(Path(tmp) / "ckpt")
        b = engine(path, args.device, args.torch_dtype, train=True)
        b.load_checkpoint(Path(tmp) / "ckpt")
        pa, pb = params(a), params(b)
        same = all(torch.equal(pa[k], pb[k]) for k in pa)
        step(a)
        step(b)
        again = max((params(a)[k] - params(b)[k]).abs().max().item() for k in pa)
    ok = same and again == 0.0
    return ok, f"loaded params bit-identical: {same}; after one more step on both: max |diff| {again:.1e}"


def lora_steps_vs_peft(args, path: str, lora) -> tuple[bool, dict, tuple[bool, str]]:
    """Two Adam steps of a LoRA engine (`lora`: a models.lora.LoraConfig) on the device, then its exported peft
    adapter on HF's base: (every base weight bit-identical, {adapter param: its largest change}, the
    engine's log-probs vs HF + peft as `close` says)."""
    batch = make_batch()
    eng = engine(path, args.device, args.torch_dtype, train=True, lora=lora)
    weights = lambda: {k: v.detach().clone() for c in eng.inner_chunks()  # noqa: E731
                       for k, v in c.named_parameters()}
    before = weights()
    for b in (batch, dict(batch, advantages=-batch["advantages"].flip(0))):
        train_on(eng, b, args.device)
    after = weights()
    base_same = all(torch.equal(before[k], after[k]) for k in before if "lora_" not in k)
    moved = {k: (after[k] - before[k]).abs().max().item() for k in before if "lora_" in k}
    got = eng.forward_only(on_device(batch, args.device), response_length=R, micro_batch_size=2)["logprobs"]
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        eng.export_lora_adapter(tmp)
        versus = close(got, hf_logprobs(path, batch, args.device, args.torch_dtype, adapter=tmp),
                       valid_positions(batch), args.bf16)
    return base_same, moved, versus


def check_lora(args, assets) -> tuple[bool, str]:
    """actor.lora on the device: two Adam steps move the adapters only (every base weight bit-identical);
    the exported peft adapter on HF's base gives the engine's log-probs (same tolerances as above)."""
    from megappo.models.lora import LoraConfig

    base_same, moved, (ok, said) = lora_steps_vs_peft(args, str(assets["tiny-llama"]), LoraConfig(rank=4, alpha=8.0))
    most = max(moved.values())
    return ok and base_same and most > 0, \
        f"base bit-identical: {base_same}; adapters moved {most:.1e}; vs HF + peft {said}"


def check_expert_lora(args, assets) -> tuple[bool, str]:
    """actor.lora.experts on the device: the tiny Mixtral (every layer routed, megatron's SequentialMLP) with
    adapters on each expert's fc1/fc2 and the attention; two steps move every expert's B, the base stays
    bit-identical, and the exported peft adapter (transformers 5's stacked expert layout) on HF's base
    gives the engine's log-probs."""
    from megappo.models.lora import LoraConfig

    base_same, moved, (ok, said) = lora_steps_vs_peft(args, str(assets["tiny-mixtral"]),
                                                      LoraConfig(rank=4, alpha=8.0, experts=True))
    experts = [v for k, v in moved.items() if ".experts." in k]
    least = min(v for k, v in moved.items() if ".experts." in k and k.endswith("lora_B"))
    return ok and base_same and least > 0, (f"base bit-identical: {base_same}; {len(experts)} expert adapter "
                                            f"tensors, each B moved >= {least:.1e}; vs HF + peft {said}")


def check_offloaded_lora_sync(args, assets) -> tuple[bool, str]:
    """actor.offload with LoRA and the merged weight sync (the 70B / 235B layouts offload the actor): the sync's
    resharder is built while the actor's weights are off the device (it must read none of them), merges each
    adapted weight when its bucket is built, and sends bit for bit what the same actor kept on the device sends;
    the offloaded actor's device memory is where it was before the sync (no merged copy held after it)."""
    from megappo.models.lora import LoraConfig, lazily_merged_named_parameters
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_megatron
    from megappo.parallel.resharding import Resharder

    path, batch = str(assets["tiny-llama"]), make_batch()
    sent, held, offloaded = {}, {}, {}
    allocated = torch.cuda.memory_allocated if args.device == "cuda" else (lambda: 0)
    for offload in (False, True):
        init_megatron(ParallelLayout(), seed=7)  # the same adapter init for both engines
        eng = engine(path, args.device, args.torch_dtype, train=True, lora=LoraConfig(rank=4, alpha=8.0), offload=offload)
        sync = Resharder(eng.inner_chunks(), eng.dims, eng.layout, rollout_tp=1,
                         named_weights=lazily_merged_named_parameters)  # as the hybrid engine builds it
        offloaded[offload] = eng.offloaded
        train_on(eng, batch, args.device)  # B != 0: the merged weights are not the base
        before = allocated()
        with eng.resident(parts=["params"]):
            sent[offload] = {n: t.float().cpu().clone() for b in sync.buckets() for n, t in b.tensors}
        held[offload] = allocated() - before
        del sync, eng
    same = sent[True].keys() == sent[False].keys() and all(torch.equal(sent[True][n], sent[False][n]) for n in sent[False])
    ok = same and offloaded[True] and held[True] <= 0
    return ok, (f"built offloaded: {offloaded[True]}; sent == resident actor's: {same} ({len(sent[True])} tensors); "
                f"device bytes held after the sync: {held[True]}")


CHECKS = {"stack": check_stack, "logprobs vs HF": check_logprobs, "train step": check_train_step,
          "packed == padded": check_packed, "MoE layer": check_moe, "checkpoint": check_checkpoint, "LoRA": check_lora,
          "expert LoRA": check_expert_lora, "offloaded LoRA sync": check_offloaded_lora_sync}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--out", default=str(REPO / "outputs" / "gpu_smoke"))
    p.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    p.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:  # before anything starts (it was a KeyError after the set-up)
        p.exit(2, f"gpu_smoke: --only: unknown check(s) {', '.join(map(repr, unknown))}; choose from "
                  f"{', '.join(map(repr, CHECKS))}\n")
    if args.device == "cuda" and not torch.cuda.is_available():  # before NCCL is initialised (that failed first)
        p.exit(2, "gpu_smoke: --device cuda but torch sees no CUDA device (no GPU, CUDA_VISIBLE_DEVICES, or a CPU "
                  "build of torch); run it on the GPU machine, or --device cpu to try it here\n")
    args.bf16 = (args.dtype or ("bf16" if args.device == "cuda" else "fp32")) == "bf16"
    args.torch_dtype = torch.bfloat16 if args.bf16 else torch.float32
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from megappo.assets import ensure_assets
    from megappo.parallel.launch import free_port
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron

    assets = ensure_assets(Path(args.out) / "assets", vision=False)
    # both backends on cuda, as the trainer's workers: the engine reduces its metric vectors on the CPU (gloo)
    init_distributed(0, 1, "127.0.0.1", free_port(), backend="cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    init_megatron(ParallelLayout(), seed=7)
    rows = {}
    for name in names:
        try:
            ok, said = CHECKS[name](args, assets)
        except Exception as e:  # noqa: BLE001 - one failing row does not hide the others
            ok, said = False, f"{type(e).__name__}: {e}".splitlines()[0][:300]
            traceback.print_exc(file=sys.stderr)
        rows[name] = {"ok": bool(ok) and not (isinstance(said, float) and math.isnan(said)), "detail": said}
    if args.json:
        print(json.dumps({"device": args.device, "dtype": "bf16" if args.bf16 else "fp32", "rows": rows}))
    else:
        width = max(map(len, rows))
        for name, r in rows.items():
            print(f"{'PASS' if r['ok'] else 'FAIL'}  {name:<{width}}  {r['detail']}")
    return 0 if all(r["ok"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
