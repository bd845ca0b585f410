"""Several runs' curves on one PNG: each run's reward curve lines (megappo/ppo/reward_curve.CURVE_KEYS, those
it logged) from its metrics.jsonl, one colour per run, one line style per metric.

    python tools/compare_runs.py outputs/tools_smollm2_135m:in-process outputs/tools_smollm2_135m_sdk:"OpenAI SDK" \
        --out docs/tools_sdk_vs_loop.png --title "calculator recipe" --keys objective/scores eval/verifiable_correct_rate
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="OUTPUT_DIR[:label] (its metrics.jsonl; the label after the last colon)")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--title", default="")
    p.add_argument("--keys", nargs="+", default=None, help="only these of the reward curve's metrics (default: all)")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megappo.ppo.reward_curve import CURVE_KEYS, reward_curve_series
    from megappo.utils.tracking import read_metrics

    styles = dict(CURVE_KEYS)
    unknown = sorted(set(args.keys or ()) - set(styles))
    if unknown:
        raise SystemExit(f"--keys {' '.join(unknown)}: not a reward curve metric; choose from {' '.join(styles)}")
    runs = []
    for spec in args.runs:
        path, _, label = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
        metrics = Path(path) / "metrics.jsonl"
        if not metrics.is_file():
            raise SystemExit(f"{metrics} does not exist: give a run's output_dir (trainer.output_dir)")
        series = {k: v for k, v in reward_curve_series(read_metrics(metrics)).items() if not args.keys or k in args.keys}
        runs.append((label or Path(path).name, series))
    if not any(series for _, series in runs):
        raise SystemExit(f"none of the runs logged {' '.join(args.keys or styles)}: choose metrics they log")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, series) in enumerate(runs):
        for key, (xs, ys) in series.items():
            ax.plot(xs, ys, styles[key], color=f"C{i}", label=f"{label}: {key}")
    ax.set_xlabel("step")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
