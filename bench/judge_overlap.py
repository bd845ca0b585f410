"""The generative judge beside the rollout (issue #75, reward.judge.overlap, ppo/judge_overlap.py): the same run
with the judge started on each group as it finishes (overlap: true) and with the judge asked in the reward step
(overlap: false). One run, this machine:

  1. the judge: `megappo serve` of the tiny llama in its own process (as tests/conftest's served judge), scoring
     every row's P(" Yes") over /v1/completions with echo (two requests a row);
  2. the policy: tiny-llama-arith on the arithmetic task, trainer.mode=fully_async (1 Megatron worker + 1 rollout
     worker, partial rollouts), GRPO, `--groups` prompts x `--n` samples a step, the judge the arithmetic
     source's only rule; trainer.max_staleness 0 (a batch's groups start after the previous update: judging
     can hide behind the rest of its own rollout and the step's forwards) and 1 (the next batch generates
     during this step's training, so its groups are judged there too), each with overlap true and false;
     and, for comparison, trainer.mode=sync (the hybrid engine on one worker: the batch comes whole, judging
     starts when it does and overlaps pi_old / ref only);
  3. per run, the median over steps 2.. (step 1 warms vLLM up) of
       rollout_wait_s   what the step waited for its batch of finished groups (timing/rollout_wait_s; sync: its
                        rollout, timing/gen_s)
       judge_s          wall seconds the step's rows were being judged (timing/judge_s)
       judge_wait_s     what the reward step still waited for the judge (timing/judge_wait_s)
       overlap_frac     1 - judge_wait_s / judge_s: the judging hidden behind the rollout and the step's forwards
       step_s           the step's wall time

Prints one JSON object (also OUT/judge_overlap.json).

    .venv/bin/python bench/judge_overlap.py [--steps 4] [--staleness 0 1] [--no-sync] [--groups 8] [--n 4]
        [--out outputs/bench_judge_overlap] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
TEMPLATE = ("You grade arithmetic homework. Question: {prompt} The answer given: {response} The right answer: "
            "{ground_truth}. Is the answer given right?")  # no quote marks: it is one YAML override
KEYS = {"rollout_wait_s": ("timing/rollout_wait_s", "timing/gen_s"), "judge_s": ("timing/judge_s",),
        "judge_wait_s": ("timing/judge_wait_s",), "overlap_frac": ("timing/judge_overlap_frac",),
        "step_s": ("timing/step_s",)}  # the first of each a run logs (sync: its rollout is timing/gen_s)


def layout(staleness) -> list[str]:
    """fully_async at trainer.max_staleness=staleness; None: trainer.mode=sync (the hybrid engine)."""
    if staleness is None:
        return ["trainer.mode=sync"]
    return ["trainer.mode=fully_async", "resources.rollout_workers=1", f"trainer.max_staleness={staleness}",
            "trainer.partial_rollout=true", "actor.policy_loss=decoupled"]


def overrides(args, url: str, data: Path, out: Path, staleness, overlap: bool) -> list[str]:
    return [*layout(staleness),
        "model.path=assets/tiny-llama-arith", f"data.train_files=[{data / 'arith_train.parquet'}]",
        f"data.val_files=[{data / 'arith_val.parquet'}]", f"data.train_batch_size={args.groups}",
        f"rollout.n={args.n}", "rollout.max_new_tokens=16", "rollout.kv_cache_memory_mb=64",
        "resources.workers_per_node=1", "actor.use_rollout_log_probs=false",
        *[f"{role}.parallel.dp=1" for role in ("actor", "ref")], "critic.enable=false",
        "algorithm.adv_estimator=grpo", f"actor.ppo_mini_batch_size={args.groups * args.n}",
        f"actor.micro_batch_size={args.groups * args.n}", "actor.ppo_epochs=1",
        f"trainer.total_steps={args.steps}", "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false",
        f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", "trainer.resume=never", "reward.num_examine=0",
        f"reward.judge.endpoint={url}/v1", "reward.judge.tokenizer=assets/tiny-llama",
        f"reward.judge.prompt='{TEMPLATE}'", "reward.judge.fallback=0.5", "reward.judge.sources=[arithmetic]",
        f"reward.judge.overlap={str(overlap).lower()}",
        *args.overrides]


def run(cfg, warm) -> list[dict]:
    from megappo.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer(cfg, show_progress=False, warm=warm)
    try:
        trainer.init_workers()
        return trainer.fit()
    finally:
        trainer.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--staleness", type=int, nargs="*", default=[0, 1], help="trainer.max_staleness of each pair")
    p.add_argument("--no-sync", dest="sync", action="store_false", help="leave out the trainer.mode=sync pair")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--out", default="outputs/bench_judge_overlap")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both variants")
    args = p.parse_args()
    os.chdir(REPO)
    import ray

    from gateway_helpers import serve_process
    from megappo.config.loader import load_config
    from megappo.data.preprocess_arithmetic import main as preprocess
    from megappo.ppo.workers import WarmWorkers
    from megappo.train import start_ray

    out = Path(args.out).resolve()
    data = out / "data"
    if not (data / "arith_train.parquet").exists():
        preprocess(["--out", str(data), "--train-size", "256", "--val-size", "8"])
    key, warm, report = "k-bench-judge", WarmWorkers(), {}
    t0 = time.perf_counter()
    with serve_process(REPO / "assets/tiny-llama", "--max-model-len", "256", "--max-tokens", "8", "--kv-cache-mb",
                       "64", key=key) as (_, url):
        os.environ["MEGAPPO_JUDGE_API_KEY"] = key
        started = False
        try:
            for staleness in [*args.staleness, *([None] if args.sync else [])]:
                for overlap in (True, False):
                    run_name = "sync" if staleness is None else f"fully_async_staleness_{staleness}"
                    name = f"{run_name}_overlap_{str(overlap).lower()}"
                    cfg = load_config(REPO / "configs/ppo_tiny.yaml",
                                      overrides(args, url, data, out / name, staleness, overlap), check_paths=True)
                    started = start_ray(cfg) or started
                    rows = run(cfg, warm)[1:]
                    report[name] = {key: round(statistics.median(r[next(k for k in keys if k in r)] for r in rows), 3)
                                    for key, keys in KEYS.items()}
        finally:
            warm.close()
            if started:
                ray.shutdown()
    report["setup"] = {"groups": args.groups, "n": args.n, "steps": args.steps,
                       "workers_reused": warm.reused, "median_over": f"steps 2..{args.steps}", "cpus": os.cpu_count(),
                       "wall_s": round(time.perf_counter() - t0, 1), "overrides": args.overrides}
    text = json.dumps(report, indent=1)
    (out / "judge_overlap.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
