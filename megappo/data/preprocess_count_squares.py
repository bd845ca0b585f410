"""Write the vision task: `python -m megappo.data.preprocess_count_squares --out DIR`.

Each row is a 112 x 112 PNG with 1 to --max-count coloured squares on white, each filling one cell of a 4 x 4 grid of
28-px cells (one merged token of Qwen2.5-VL's tower each), and the question "How many squares are in the image?
Answer with #### and the number." Ground truth: the count; data_source "count_squares", which has no built-in rule:
the config names one (configs/grpo_tiny_vl.yaml: reward.rules.count_squares, the arithmetic task's #### scorer).
Only the image tells the answer: every prompt's text is the same. Deterministic by --seed; writes
squares_train.parquet and squares_val.parquet (another seed's images).
"""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path

DATA_SOURCE = "count_squares"
QUESTION = "How many squares are in the image? Answer with #### and the number."
SIZE, CELLS = 112, 4
COLOURS = ((220, 30, 30), (30, 160, 40), (40, 60, 220), (230, 160, 20), (150, 40, 180))


def squares_png(count: int, rng: random.Random) -> bytes:
    """A white image with `count` squares of random colours in distinct grid cells, PNG-encoded."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    draw, cell = ImageDraw.Draw(image), SIZE // CELLS
    for k in rng.sample(range(CELLS * CELLS), count):
        x, y = (k % CELLS) * cell, (k // CELLS) * cell
        draw.rectangle([x + 3, y + 3, x + cell - 4, y + cell - 4], fill=rng.choice(COLOURS))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def make_rows(n: int, seed: int, max_count: int, split: str) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        count = rng.randint(1, max_count)
        rows.append({"prompt": [{"role": "user", "content": f"<image>{QUESTION}"}],
                     "images": [squares_png(count, rng)],
                     "data_source": DATA_SOURCE,
                     "reward_model": {"ground_truth": str(count), "style": "rule"},
                     "extra_info": {"split": split, "index": i, "count": count}})
    return rows


def main(argv: list[str] | None = None) -> int:
    from megappo.data.preprocess_arithmetic import task_parser, write_parquet

    parser = task_parser(__doc__.splitlines()[0], 512)
    parser.add_argument("--max-count", type=int, default=4, help=f"squares per image: 1..this (<= {CELLS * CELLS})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.max_count <= CELLS * CELLS:
        parser.error(f"--max-count {args.max_count}: choose 1..{CELLS * CELLS}")
    for split, size, seed in (("train", args.train_size, args.seed), ("val", args.val_size, args.seed + 1)):
        path = write_parquet(make_rows(size, seed, args.max_count, split), Path(args.out) / f"squares_{split}.parquet")
        print(f"wrote {size} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
