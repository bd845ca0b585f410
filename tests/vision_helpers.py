"""Prompts with images as the data side makes them (a parquet images column through RLHFDataset and collate), shared
by the vision tests."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path


def png(height: int, width: int, seed: int) -> bytes:
    from megappo.assets import noise_image

    buf = io.BytesIO()
    noise_image(height, width, seed).save(buf, format="PNG")
    return buf.getvalue()


def vl_prompts(path, row_images: list) -> "DataProto":  # noqa: F821
    """One prompt row per entry of `row_images` (its images' (height, width) in pixels, noise), through RLHFDataset:
    ids expanded by the model's processor and left-padded, pixel_values / image_grid_thw beside them, the PNG bytes
    in non_tensor images."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoProcessor, AutoTokenizer

    from megappo.data.dataset import RLHFDataset

    rows = [{"prompt": f"how many squares {r}?", "images": [png(h, w, 10 * r + i) for i, (h, w) in enumerate(sizes)],
             "data_source": "count", "reward_model": {"ground_truth": "1", "style": "rule"}}
            for r, sizes in enumerate(row_images)]
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(pa.Table.from_pylist(rows), Path(tmp) / "rows.parquet")
        data = RLHFDataset(Path(tmp) / "rows.parquet", AutoTokenizer.from_pretrained(path), max_prompt_length=256,
                           processor=AutoProcessor.from_pretrained(path))
    return data.get_batch(range(len(rows)))
