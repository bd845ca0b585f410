"""Sync vs one-step async vs fully_async on a long-tailed workload, and bench/async_sim.py checked against
them (issue #39). One run, this machine:

  1. data: the SmolLM2 arithmetic task with "Explain your reasoning, then give the number." (held-out
     validation), whose samples at temperature 1 run from a few tokens to the length cap (`--instruction`,
     `--temperature` and `key=value` overrides change the workload; they are part of the report's key);
  2. costs (a separate vLLM process, one thread, as a rollout worker has): seconds per decode step at each
     batch size, prefill seconds per prompt token;
  3. the three modes, each `--steps` PPO steps of the same batches (GRPO, `--groups` prompts x `--n`
     samples; packed micro-batches of <= 1024 tokens, as a long tail wants), then held-out accuracy (greedy,
     `--val-size` prompts):
       sync         2 workers, each a Megatron DP rank with its colocated vLLM (the hybrid engine)
       async        1 Megatron worker + 1 rollout worker (one step off-policy)
       fully_async  1 Megatron worker + 1 rollout worker, partial rollouts, trainer.max_staleness=1
     Per mode: wall seconds, trained tokens per second, held-out accuracy, and each sample's length.
     `--modes sync+loglinear fully_async+loglinear`: the same with A-3PO's proximal policy (no pi_old forward);
  4. the simulator, given the measured decode table, the trainer's per-phase timers of each layout (update
     seconds per trained token over steps 2.., the weight sync's median) and the measured lengths, and
     its prediction of each mode's trained tokens per second next to the measured one.

Prints one JSON object (also written to OUT/async_modes.json). Each mode's run is kept in OUT/<mode>_run.json and
reused by the next invocation (delete it to run that mode again); so is the decode table.

    .venv/bin/python bench/async_modes.py [--steps 3] [--groups 4] [--n 4] [--max-new-tokens 192]
        [--modes sync async fully_async] [--dtype fp32] [--instruction TEXT] [--temperature 1.0]
        [--out outputs/bench_async_modes] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
MODEL = "assets/smollm2-135m-instruct"
INSTRUCTION = "Explain your reasoning, then give the number."
LAYOUT = {  # the two cores of this machine: one per process, whatever the mode
    "sync": ["resources.workers_per_node=2", "actor.parallel.dp=2"],
    "async": ["resources.workers_per_node=1", "actor.parallel.dp=1", "resources.rollout_workers=1"],
    "fully_async": ["resources.workers_per_node=1", "actor.parallel.dp=1", "resources.rollout_workers=1",
                    "trainer.max_staleness=1", "trainer.partial_rollout=true"],
}
A3PO = ["actor.policy_loss=decoupled", "actor.proximal=loglinear"]  # no pi_old forward before the update
VARIANTS = {**{m: (m, LAYOUT[m]) for m in LAYOUT},  # name -> (trainer.mode, overrides)
            "sync+loglinear": ("sync", LAYOUT["sync"] + A3PO),
            "fully_async+loglinear": ("fully_async", LAYOUT["fully_async"] + A3PO)}
DECODE_BATCHES = (1, 4, 8, 16, 32, 64)
MAX_NUM_SEQS = 256  # the simulated engine's slots: more than this bench ever has in flight (two batches)


def make_data(out: Path, val_size: int, instruction: str) -> Path:
    from megappo.data.preprocess_arithmetic import main as preprocess

    data, made = out / "data", {"val_size": val_size, "instruction": instruction}
    stamp = data / "made_with.json"  # reused data must be the data these arguments ask for
    if not (data / "arith_train.parquet").exists():
        preprocess(["--out", str(data), "--held-out", "--min-operand", "0", "--max-operand", "30",
                    "--val-size", str(val_size), "--instruction", instruction])
        stamp.write_text(json.dumps(made))
    if stamp.exists() and json.loads(stamp.read_text()) != made:
        raise SystemExit(f"{data} was made with {stamp.read_text()}, not these arguments: delete it or pass another --out")
    return data


def measure_decode(model: str, dtype: str, prompt_len: int, out: Path) -> dict:
    """Per decode step seconds at each batch size, and prefill seconds per prompt token: vLLM in a child process
    (one OpenMP thread, unbound: a rollout worker's setting), ignore_eos so every sample runs the same length."""
    path = out / "decode_costs.json"
    if not path.exists():
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        subprocess.run([sys.executable, __file__, "--_decode", model, dtype, str(prompt_len), str(path)],
                       check=True, env=env)
    return json.loads(path.read_text())


def _decode_child(model: str, dtype: str, prompt_len: int, path: str) -> None:
    from megappo.config.schema import RolloutConfig
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    rollout = VLLMRollout(model, RolloutConfig(kv_cache_memory_mb=2048), seed=0,
                          dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype], max_model_len=prompt_len + 160)
    from vllm import SamplingParams

    llm = rollout.llm
    prompt = list(range(1000, 1000 + prompt_len))  # ids do not change the cost; the length does

    calls = iter(range(10**9))

    def run(batch, tokens):  # every call its own prompts: no prefix-cache hit makes a prefill look cheap
        sp = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=1.0, seed=0)
        base = next(calls) * batch
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": [(x + 7 * (base + i)) % 40000 for x in prompt]} for i in range(batch)],
                     sp, use_tqdm=False)
        return time.perf_counter() - t

    run(4, 8)  # warm-up
    decode, first = {}, {}
    for b in DECODE_BATCHES:
        first[b] = min(run(b, 1) for _ in range(2))
        decode[b] = (min(run(b, 129) for _ in range(2)) - first[b]) / 128
        print(f"decode batch {b}: {decode[b] * 1e3:.1f} ms/step, prefill {first[b]:.2f}s", file=sys.stderr)
    prefill = statistics.median((first[b] - decode[1]) / (b * prompt_len) for b in DECODE_BATCHES if b >= 8)
    Path(path).write_text(json.dumps({"decode_s": {str(b): round(v, 6) for b, v in decode.items()},
                                      "prefill_s_per_token": round(max(prefill, 0.0), 8)}))


def run_mode(name: str, data: Path, out: Path, args) -> dict:
    """`args.steps` PPO steps of variant `name`, then greedy validation; the history and every trained sample's
    length."""
    from ppo_step import train

    from megappo.config.loader import load_config

    batch = args.groups * args.n
    mode, layout = VARIANTS[name]
    overrides = [
        f"model.path={args.model}", f"model.dtype={args.dtype}", f"trainer.mode={mode}",
        f"trainer.total_steps={args.steps}", f"trainer.output_dir={out / name}", "trainer.save_every=0",
        f"trainer.val_every={args.steps}", "trainer.loggers=[jsonl]",
        "reward.num_examine=0", "trainer.resume=never", "trainer.export_hf=false",
        f"data.train_files=[{data / 'arith_train.parquet'}]", f"data.val_files=[{data / 'arith_val.parquet'}]",
        f"data.train_batch_size={args.groups}", f"data.val_batch_size={args.val_size}",
        f"rollout.n={args.n}", f"rollout.temperature={args.temperature}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.kv_cache_memory_mb=1024", f"actor.ppo_mini_batch_size={batch}", "actor.micro_batch_size=4",
        "actor.log_prob_micro_batch_size=8", "actor.pack_sequences=true",
        "actor.max_tokens_per_micro_batch=1024", *layout, *args.overrides]
    cfg = load_config(REPO / "configs/grpo_smollm2_135m.yaml", overrides, check_paths=True)
    lengths: list[int] = []
    prompt_lens: list[int] = []

    def setup(trainer):
        update = trainer._update  # wrapped (a bench, not an API) to see each trained batch

        def recorded(b, timing):  # every trained sample's response and prompt length
            resp = b.batch["response_mask"].sum(-1)
            lengths.extend(int(x) for x in resp)
            prompt_lens.extend(int(x) for x in b.batch["attention_mask"].sum(-1) - resp)
            return update(b, timing)

        trainer._update = recorded

    history, init_s, fit_s = train(cfg, setup)
    val_s = sum(r.get("timing/validate_s", 0.0) for r in history)
    train_tokens = sum(r["tokens/actor_real"] for r in history)
    return {"mode": mode, "name": name, "history": history, "lengths": lengths, "prompt_lens": prompt_lens,
            "init_s": init_s, "fit_s": fit_s,
            "val_s": val_s, "train_s": fit_s - val_s, "trained_tokens": train_tokens,
            "trained_tokens_per_s": train_tokens / max(fit_s - val_s, 1e-9),
            "eval_accuracy": next((r[k] for r in reversed(history) for k in r if k.startswith("eval/")
                                   and k.endswith("correct_rate")), None)}


UPDATE_PHASES = ("timing/old_log_prob_s", "timing/ref_s", "timing/values_s", "timing/update_critic_s",
                 "timing/update_actor_s", "timing/reward_adv_s")


def sim_inputs(res: dict, decode: dict, prompt_len: int, args) -> dict:
    """The simulator's inputs for one measured layout: its trainer's phase timers (seconds per token), its weight
    sync, the decode table and the lengths its samples had."""
    rows = res["history"][1:] or res["history"]  # step 1 warms up
    per_token = sum(sum(r.get(k, 0.0) for k in UPDATE_PHASES) for r in rows) / sum(r["tokens/actor_real"] for r in rows)
    mode, layout = VARIANTS[res["name"]]
    return {**decode, "update_s_per_token": per_token, "update_s_fixed": 0.0,
            "weight_sync_s": statistics.median(r.get("timing/weight_sync_s", 0.0) for r in rows),
            "prompt_len": prompt_len, "lengths": res["lengths"], "groups_per_step": args.groups, "n": args.n,
            "max_num_seqs": MAX_NUM_SEQS, "max_staleness": int(_override(layout, "trainer.max_staleness", 1)),
            "engines": int(_override(layout, "resources.workers_per_node" if mode == "sync"
                                     else "resources.rollout_workers", 1))}


def _override(layout: list[str], key: str, default):
    """The value a layout's `key=value` override gives, else `default`."""
    return next((o.split("=", 1)[1] for o in layout if o.startswith(key + "=")), default)


def plot(report: dict, path: Path) -> None:
    """Measured vs predicted trained tokens/s per mode, one bar pair each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    measured = [report["modes"][m]["trained_tokens_per_s"] for m in modes]
    predicted = [report["modes"][m]["predicted_tokens_per_s"] for m in modes]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], predicted, 0.4, label="bench/async_sim.py")
    for x, m, p in zip(xs, measured, predicted):
        ax.annotate(f"{p / m - 1:+.0%}", (x + 0.2, p), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), modes)
    ax.set_ylabel("trained tokens / s")
    w = report["workload"]
    ax.set_title(f"{Path(w['model']).name} {w['dtype']}, {w['groups']}x{w['n']} samples/step, <= {w['max_new_tokens']} "
                 f"tokens, {w['steps']} steps", fontsize=9)
    ax.set_ylim(0, max(measured + predicted) * 1.3)  # room for the legend above the bars and their labels
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--_decode":
        _decode_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--val-size", type=int, default=32)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--instruction", default=INSTRUCTION, help=f"after each question (default: {INSTRUCTION!r})")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--modes", nargs="+", default=list(LAYOUT), choices=list(VARIANTS))
    p.add_argument("--out", default="outputs/bench_async_modes")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every mode")
    args = p.parse_args(argv)
    for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "RAY_AUTH_MODE": "disabled",
                 "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = make_data(out, args.val_size, args.instruction)
    from transformers import AutoTokenizer

    import pyarrow.parquet as pq

    from megappo.data.dataset import prompt_to_text

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = pq.read_table(data / "arith_train.parquet").column("prompt").to_pylist()[:64]
    prompt_len = round(statistics.fmean(len(tok(prompt_to_text(p, tok), add_special_tokens=False).input_ids)
                                        for p in prompts))
    decode = measure_decode(args.model, args.dtype, prompt_len, out)

    from async_sim import run as simulate

    report = {"workload": {"model": args.model, "dtype": args.dtype, "groups": args.groups, "n": args.n,
                           "max_new_tokens": args.max_new_tokens, "steps": args.steps, "prompt_len": prompt_len,
                           "temperature": args.temperature, "instruction": args.instruction,
                           **({"overrides": args.overrides} if args.overrides else {})},
              "decode": decode, "modes": {}}
    previous = out / "async_modes.json"  # modes run before in this OUT stay in the report
    earlier = json.loads(previous.read_text()) if previous.exists() else {}
    if earlier.get("workload") == report["workload"]:
        report["modes"] = earlier["modes"]
    for mode in args.modes:
        saved = out / f"{mode}_run.json"  # a finished mode is reused (delete it to run the mode again)
        if not saved.exists():
            saved.write_text(json.dumps({**run_mode(mode, data, out, args), "workload": report["workload"]}))
        res = json.loads(saved.read_text())
        if res.get("workload", report["workload"]) != report["workload"]:
            raise SystemExit(f"{saved} was run with {res['workload']}, not these arguments: delete it or pass "
                             "another --out")
        lengths = sorted(res["lengths"])
        inputs = sim_inputs(res, decode, round(statistics.fmean(res["prompt_lens"])), args)
        trainer_mode = VARIANTS[mode][0]
        predicted = simulate(inputs, args.steps, modes=(trainer_mode,))[trainer_mode]
        report["modes"][mode] = {
            "fit_s": round(res["fit_s"], 1), "val_s": round(res["val_s"], 1), "train_s": round(res["train_s"], 1),
            "trained_tokens": res["trained_tokens"], "trained_tokens_per_s": round(res["trained_tokens_per_s"], 2),
            "eval_accuracy": res["eval_accuracy"],
            "lengths": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
            "sim_inputs": {k: (round(v, 8) if isinstance(v, float) else v) for k, v in inputs.items()
                           if k not in ("lengths", "decode_s", "prefill_s_per_token")},
            "predicted_tokens_per_s": predicted["trained_tokens_per_s"],
            "prediction_error": round(predicted["trained_tokens_per_s"] / res["trained_tokens_per_s"] - 1, 4)}
        print(json.dumps({mode: report["modes"][mode]}), file=sys.stderr, flush=True)
    if "sync" in report["modes"]:
        base = report["modes"]["sync"]["trained_tokens_per_s"]
        for m in report["modes"].values():
            m["speedup_vs_sync"] = round(m["trained_tokens_per_s"] / base, 3)
    (out / "async_modes.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "async_modes.png")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
