"""The first command to run on a GPU machine: `make gpu-check` (= python tools/gpu_check.py).

1. The CUDA stack against the pins in requirements-gpu.txt and requirements-gpu-te.txt (torch, vllm,
   megatron-core, transformer-engine, ray, transformers).
2. The tiny config for a few PPO steps through every GPU-only path: resources.device=cuda, bf16
   (megatron mixed precision + vLLM bf16), Transformer Engine's layer spec when TE is installed,
   nccl process groups, vLLM on CUDA with sleep (level 2) / wake around each rollout, the direct
   weight load, actor/critic/ref host offload (pinned memory, empty_cache). Then one run per
   SCENARIOS row, each its own rows in the table: packing with a token budget, a multi-turn
   (calculator) step, a checkpoint saved and resumed (TE's / megatron's distributed optimizer state
   over NCCL), and on 2+ GPUs the actor at TP2 (rollout TP2), at PP2, and the tiny Qwen3-MoE at EP2
   (TE experts, alltoall over NCCL, the fused-MoE refit into vLLM).
3. A pass/fail table with the parity metrics: weights fingerprinted after every sync, vLLM vs
   Megatron log-probs of the sampled tokens (bf16: |diff| mean < 0.05), rewards finite.

    python tools/gpu_check.py --only packing,resume     # some scenarios (names: SCENARIOS)

Exit 1 when any row fails, and when this interpreter has no GPU stack (a CPU torch, or no visible
GPU): the message names the venv it looked in. The tiny model and data are built locally (megappo assets); nothing is downloaded.

    python tools/gpu_check.py [--gpus N] [--steps 3] [--out outputs/gpu_check] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the files scripts/install_gpu.sh installs from (make install-gpu): every pin is read from them
PIN_FILES = (REPO / "requirements-gpu.txt", REPO / "requirements-gpu-te.txt")


def pinned_versions(paths=PIN_FILES) -> dict[str, str]:
    """name -> pinned spec (`==x` or a range) from the GPU requirements files (extras dropped)."""
    pins = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*((?:==|>=|<=|<|>)[^\s]+)$", line)
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


def _satisfies(installed: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(installed.split("+")[0]) in SpecifierSet(spec)  # 2.13.0+cu130 satisfies ==2.13.0


def check_versions() -> list[tuple[str, bool, str]]:
    rows = []
    for name in ("torch", "vllm", "megatron-core", "transformer-engine", "ray", "transformers"):
        spec = pinned_versions().get(name)
        try:
            got = version(name)
        except PackageNotFoundError:
            rows.append((f"version {name}", name == "transformer-engine", f"not installed (pin {spec}); "
                         + ("TE is optional: megatron's local spec is used" if name == "transformer-engine" else "")))
            continue
        ok = spec is None or _satisfies(got, spec)
        rows.append((f"version {name}", ok, f"{got} (pin {spec})"))
    return rows


# the log-prob parity row's bound on mean |log p_vLLM - log p_Megatron| per step, by model.dtype
PARITY_TOLERANCE = {"bf16": 0.05, "fp32": 1e-4}


def run_overrides(out: Path, steps: int, tp: int, gpus: int, device: str = "cuda", dtype: str = "bf16") -> list[str]:
    """configs/ppo_tiny.yaml's overrides for the check run (the tiny model and data built locally).
    pi_old is the actor's own forward (actor.use_rollout_log_probs=false, whatever the config says):
    with the sampler's log-probs copied in, the parity row would compare vLLM with itself. The rollout guard
    warns instead of stopping (trainer.rollout_check=warn): a gap past its bound is this check's row to report."""
    from megappo.assets import ensure_assets
    from megappo.data.preprocess_arithmetic import main as make_data

    assets = ensure_assets(REPO / "assets", vision=False)
    make_data(["--out", str(out / "data"), "--train-size", "64", "--val-size", "8"])
    return [
        f"model.path={assets['tiny-llama']}", f"model.dtype={dtype}", f"resources.device={device}",
        f"resources.workers_per_node={gpus}", "resources.nodes=1", "actor.use_rollout_log_probs=false",
        f"actor.parallel.tp={tp}", "actor.parallel.pp=1", f"actor.parallel.dp={gpus // tp}",
        "critic.parallel.tp=1", "critic.parallel.pp=1", f"critic.parallel.dp={gpus}",
        "ref.parallel.tp=1", "ref.parallel.pp=1", f"ref.parallel.dp={gpus}",
        f"rollout.tp={tp}", "rollout.gpu_memory_utilization=0.25", "rollout.sleep_level=2",
        "rollout.weight_load=direct", "actor.offload=true", "critic.offload=true", "ref.offload=true",
        f"data.train_files=[{out / 'data/arith_train.parquet'}]", f"data.val_files=[{out / 'data/arith_val.parquet'}]",
        "data.train_batch_size=8", "rollout.n=2", "rollout.max_new_tokens=8",
        f"actor.ppo_mini_batch_size={8 * gpus}", "actor.micro_batch_size=4",
        f"critic.ppo_mini_batch_size={8 * gpus}", "critic.micro_batch_size=4",
        f"trainer.total_steps={steps}", "trainer.save_every=0", f"trainer.val_every={steps}",
        f"trainer.output_dir={out / f'tp{tp}'}", "trainer.loggers=[jsonl]", "trainer.resume=never",
        # the parity row reports the sampler/trainer gap itself: the rollout guard would stop the run before it
        "trainer.rollout_check=warn",
    ]


def _all_roles(key: str, value) -> list[str]:
    return [f"{role}.{key}={value}" for role in ("actor", "critic", "ref")]


def _moe(out: Path, gpus: int) -> list[str]:
    from megappo.assets import ensure_assets

    model = ensure_assets(REPO / "assets", vision=False)["tiny-qwen3_moe"]
    return [f"model.path={model}", *_all_roles("parallel.ep", 2), *_all_roles("parallel.dp", gpus)]


# name -> (GPUs it needs, config, the overrides on top of run_overrides' (out, gpus) -> list, actor TP).
# `resume` runs twice: steps-1 steps with a checkpoint each step, then the last step resumed from it.
SCENARIOS = {
    "tp1": (1, "configs/ppo_tiny.yaml", lambda out, gpus: [], 1),
    "tp2": (2, "configs/ppo_tiny.yaml", lambda out, gpus: [], 2),
    "pp2": (2, "configs/ppo_tiny.yaml",
            lambda out, gpus: ["actor.parallel.pp=2", f"actor.parallel.dp={gpus // 2}"], 1),
    "moe_ep2": (2, "configs/ppo_tiny_moe.yaml", _moe, 1),
    "packing": (1, "configs/ppo_tiny.yaml", lambda out, gpus: [
        *_all_roles("pack_sequences", "true"), *_all_roles("max_tokens_per_micro_batch", 256)], 1),
    "multi_turn": (1, "configs/ppo_tiny.yaml", lambda out, gpus: [
        "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=2", "rollout.max_new_tokens=16"], 1),
    "resume": (1, "configs/ppo_tiny.yaml", lambda out, gpus: ["trainer.save_every=1", "trainer.async_save=true"], 1),
}


def scenario_overrides(name: str, out: Path, steps: int, gpus: int, device: str = "cuda",
                       dtype: str = "bf16") -> tuple[str, list[str]]:
    """(config, overrides) of one SCENARIOS row; its output dir is out/<name>."""
    _, config, extra, tp = SCENARIOS[name]
    base = run_overrides(out, steps, tp, gpus, device=device, dtype=dtype)
    base = [o for o in base if not o.startswith("trainer.output_dir=")] + [f"trainer.output_dir={out / name}"]
    return config, base + extra(out, gpus)


def _train(config: str, overrides: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "train", "--config", config, "--no-progress",
                           *overrides], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError((proc.stdout + proc.stderr)[-2000:])
    return proc.stdout


def _metrics(out_dir: Path) -> list[dict]:
    """One row per step (a resumed run drops the rows after its checkpoint before it appends: utils/tracking.py)."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _tiny_run(out: Path, steps: int, name: str, gpus: int) -> tuple[list[dict], list[tuple[str, bool, str]]]:
    """Run one scenario; (metrics per step, the scenario's own extra rows)."""
    config, overrides = scenario_overrides(name, out, steps, gpus)
    if name != "resume":
        _train(config, overrides)
        return _metrics(out / name), []
    first = [o for o in overrides if not o.startswith("trainer.total_steps=")] + [f"trainer.total_steps={steps - 1}"]
    _train(config, first)
    resumed = [o for o in overrides if not o.startswith("trainer.resume=")] + ["trainer.resume=auto"]
    log = _train(config, resumed)
    ok = f"at step {steps - 1}" in log
    return _metrics(out / name), [(f"{name}: resumed from the step-{steps - 1} checkpoint", ok,
                                   next((ln for ln in log.splitlines() if ln.startswith("resumed from")), "no resume"))]


def run_rows(name: str, rows: list[dict], steps: int, dtype: str = "bf16") -> list[tuple[str, bool, str]]:
    """The table's rows for one run's metrics (one dict per step)."""
    diffs = [r.get("rollout/logprob_diff_mean", math.nan) for r in rows]
    tol = PARITY_TOLERANCE[dtype]
    return [
        (f"{name}: {steps} steps", len(rows) == steps, f"{len(rows)} steps logged"),
        (f"{name}: weight fingerprints", all(r.get("rollout/weights_fingerprint_ok") == 1.0 for r in rows),
         "every sync"),
        # math.nan < tol is False: a step without the metric fails the row
        (f"{name}: vLLM vs Megatron log-probs ({dtype})", bool(diffs) and all(d < tol for d in diffs),
         f"mean |diff| per step (< {tol:g}): " + ", ".join(f"{d:.3g}" for d in diffs)),
        (f"{name}: rewards finite", all(math.isfinite(r.get("objective/scores", math.nan)) for r in rows), ""),
    ]


def check_run(out: Path, steps: int, scenario: str, gpus: int) -> list[tuple[str, bool, str]]:
    name = f"{scenario} on {gpus} GPU(s)"
    try:
        rows, extra = _tiny_run(out, steps, scenario, gpus)
    except Exception as e:  # noqa: BLE001 - reported as a failed row
        return [(name, False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")]
    return run_rows(name, rows, steps) + extra


# the oldest Linux driver each CUDA major runs on (NVIDIA's CUDA release notes): PyPI's torch 2.13.0 is CUDA 13.0
MIN_DRIVER = {12: 525, 13: 580}


def nvidia_driver_version() -> str | None:
    """The driver version nvidia-smi reports for the first GPU; None without nvidia-smi or an answer."""
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    first = res.stdout.split()
    return first[0] if res.returncode == 0 and first else None


def driver_too_old(torch_cuda: str, driver: str | None, warned: list[str]) -> str | None:
    """Why a CUDA torch sees no GPU when the driver is the cause, else None: torch's own warning from
    torch.cuda.is_available() ("The NVIDIA driver on your system is too old (found version N)"), or nvidia-smi's
    driver version below the minimum for torch's CUDA major."""
    for w in warned:
        if "driver on your system is too old" in w:
            return f"the NVIDIA driver is too old for CUDA {torch_cuda} (torch: {w.split('. ')[0].strip()})"
    need = MIN_DRIVER.get(int(torch_cuda.split(".")[0]))
    m = re.match(r"(\d+)\.", driver or "")
    if need and m and int(m.group(1)) < need:
        return f"the NVIDIA driver {driver} is older than {need}, the minimum for CUDA {torch_cuda}"
    return None


def gpu_stack_problem() -> str | None:
    """None when this interpreter has a CUDA torch that sees a GPU; else one line naming the venv."""
    import warnings

    import torch

    where = f"{sys.executable} (venv {sys.prefix})"
    if torch.version.cuda is None:
        return (f"no GPU stack: {where} has torch {torch.__version__}, a CPU build; run `make gpu-check` after "
                "`make install-gpu` (the GPU venv, .venv-gpu), or GPU_PY=<the GPU env's python>")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        old = driver_too_old(torch.version.cuda, nvidia_driver_version(), [str(w.message) for w in caught])
        if old is not None:
            return f"GPU driver too old: {where} has CUDA torch {torch.__version__} but {old}: update the driver"
        return f"no visible GPU: {where} has CUDA torch {torch.__version__} but sees no device (CUDA_VISIBLE_DEVICES?)"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible, at most 2)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "outputs/gpu_check"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", default="", help="comma-separated SCENARIOS names (default: all that fit the GPUs)")
    args = p.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(SCENARIOS))
    if unknown:
        p.error(f"--only {','.join(unknown)}: no such scenario; choose from {', '.join(SCENARIOS)}")
    import torch

    problem = gpu_stack_problem()
    if problem is not None:  # a GPU check that cannot check fails: a green row here must mean the GPU ran
        print(f"gpu-check: FAILED: {problem}", file=sys.stderr)
        return 1
    gpus = args.gpus or min(2, torch.cuda.device_count())
    rows = check_versions()
    out = Path(args.out)
    for name, (need, *_rest) in SCENARIOS.items():
        if (not only or name in only) and need <= gpus:
            rows += check_run(out, args.steps, name, gpus)
        elif name in only:
            rows.append((name, False, f"needs {need} GPUs, {gpus} visible"))
    if args.json:
        print(json.dumps([{"check": n, "ok": ok, "detail": d} for n, ok, d in rows]))
    else:
        width = max(len(n) for n, _, _ in rows)
        for n, ok, d in rows:
            print(f"{'PASS' if ok else 'FAIL'}  {n:<{width}}  {d}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
