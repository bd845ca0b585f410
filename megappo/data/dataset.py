"""RLHFDataset: prompts from parquet, tokenized once at load; `collate` builds a left-padded DataProto.

Parquet schema (written by megappo.data.preprocess_*):
  prompt        list of chat messages [{"role", "content"}] or a plain string
  data_source   str, picks the reward rule (see megappo.rewards)
  reward_model  {"ground_truth": str, "style": "rule"}
  extra_info    dict (optional)
  images        list of images (optional; a vision-language model's prompts: data/images.py)

A vision-language model (`processor`: its HF processor): a row's prompt is tokenized with its images expanded as
the processor expands them (the ids the trainer scores), and the batch carries the pixels (data/images.py).

Multi-turn runs (`tools_for`: data_source -> tool names, agent/environment.Environments.tools_for): each
prompt shows its row's tools, and the row carries their names (non_tensor "tools") to the rollout.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pyarrow.parquet as pq
import torch

from megappo.data.images import IMAGES, decode, pixel_batch, read_images, with_image_parts
from megappo.protocol import DataProto

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "reward_model")
PREPROCESS_HINT = "python -m megappo.data.preprocess_arithmetic --out DIR (or preprocess_gsm8k)"


def prompt_to_text(prompt: Any, tokenizer, apply_chat_template: bool = True, tools: Optional[list] = None,
                   tool_prompt: Optional[str] = None) -> str:
    """Chat messages (or a string, taken as one user message) -> the prompt text for generation.
    `tools` (JSON schemas): shown to the model as agent/format.with_tools says."""
    if not apply_chat_template:
        if isinstance(prompt, str):
            return prompt
        raise ValueError("RLHFDataset: prompts are chat messages but data.apply_chat_template is false; "
                         "store plain string prompts or enable the chat template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    extra = {}
    if tools:
        from megappo.agent.format import with_tools

        messages, extra = with_tools(messages, tokenizer, tools, tool_prompt)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)


class RLHFDataset:
    """Rows of {input_ids, raw_prompt, data_source, reward_model, extra_info, index}.

    Prompts longer than `max_prompt_length` tokens are dropped at load; their count is logged and
    kept in `num_filtered`."""

    def __init__(
        self,
        parquet_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer,
        prompt_key: str = "prompt",
        max_prompt_length: int = 128,
        apply_chat_template: bool = True,
        tools_for: Optional[Callable[[str], Sequence[str]]] = None,
        tool_prompt: Optional[str] = None,
        processor=None,
    ):
        files = [parquet_files] if isinstance(parquet_files, (str, os.PathLike)) else list(parquet_files)
        self.tokenizer = tokenizer
        self.processor = processor
        self.max_prompt_length = max_prompt_length
        self.rows: list[dict[str, Any]] = []
        self.num_filtered = 0
        for file in files:
            rows = _read_rows(Path(file), prompt_key)
            tools = _row_tools(rows, tools_for, file) if tools_for is not None else [((), None)] * len(rows)
            images = _row_images(rows, file, processor)
            prompts = [row[prompt_key] if imgs is None else with_image_parts(row[prompt_key], len(imgs), f"{file} row {i}")
                       for i, (row, imgs) in enumerate(zip(rows, images))]
            texts = [prompt_to_text(prompt, tokenizer, apply_chat_template, schemas, tool_prompt)
                     for prompt, (_, schemas) in zip(prompts, tools)]
            all_ids = [_expanded_ids(processor, text, imgs) for text, imgs in zip(texts, images)] if processor else \
                tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"] if texts else []
            for row, ids, row_tools, imgs in zip(rows, all_ids, tools, images):
                if len(ids) > max_prompt_length:
                    self.num_filtered += 1
                    continue
                self.rows.append({
                    **({"tools": row_tools[0]} if tools_for is not None else {}),
                    **({IMAGES: imgs} if imgs is not None else {}),
                    "input_ids": ids,
                    "raw_prompt": row[prompt_key],
                    "data_source": row["data_source"],
                    "reward_model": row["reward_model"],
                    "extra_info": row.get("extra_info") or {},
                    "index": len(self.rows),
                })
        if self.num_filtered:
            logger.warning("RLHFDataset: filtered %d prompts longer than max_prompt_length=%d tokens (kept %d)",
                           self.num_filtered, max_prompt_length, len(self.rows))
        if not self.rows:
            raise ValueError(f"RLHFDataset: no prompts left from {[str(f) for f in files]} "
                             f"({self.num_filtered} longer than max_prompt_length={max_prompt_length})")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def get_batch(self, indices: Sequence[int]) -> DataProto:
        return collate([self.rows[int(i)] for i in indices], self.tokenizer, self.max_prompt_length,
                       self.processor.image_processor if self.processor is not None else None)


def _row_images(rows: list[dict], file, processor) -> list:
    """Each row's images (encoded bytes) when the model takes images (`processor`), else None per row; a file with
    images for a text model is refused in one line."""
    has = bool(rows) and IMAGES in rows[0]
    if processor is None:
        if has and any(r[IMAGES] for r in rows):
            raise ValueError(f"RLHFDataset: {str(file)!r} has an images column but the model is a text model: use a "
                             "vision-language model (model.path) or drop the column")
        return [None] * len(rows)
    return [read_images(r.get(IMAGES), Path(file).parent, f"{file} row {i}") for i, r in enumerate(rows)]


def _expanded_ids(processor, text: str, images: list) -> list[int]:
    """The prompt's ids with each image expanded into its pad tokens, as the processor (and the trainer) has it."""
    got = processor(text=[text], images=[decode(b) for b in images] or None, return_tensors="pt")
    return got["input_ids"][0].tolist()


def _row_tools(rows: list[dict], tools_for: Callable[[str], Sequence[str]], file) -> list[tuple]:
    """(tool names, their JSON schemas) per row, by its data_source; a source without tools is named in one line."""
    from megappo.agent.tools import tool_schemas

    by_source: dict[str, tuple] = {}
    out = []
    for i, row in enumerate(rows):
        source = str(row["data_source"])
        if source not in by_source:
            try:
                names = tuple(tools_for(source))
            except ValueError as e:
                raise ValueError(f"RLHFDataset: {str(file)!r} row {i}: {e}") from None
            by_source[source] = (names, tool_schemas(names))
        out.append(by_source[source])
    return out


def _read_rows(file: Path, prompt_key: str) -> list[dict[str, Any]]:
    if not file.is_file():
        raise FileNotFoundError(f"RLHFDataset: parquet file {str(file)!r} not found; write it with `{PREPROCESS_HINT}`")
    table = pq.read_table(file)
    for column in (prompt_key, *REQUIRED_COLUMNS):
        if column not in table.column_names:
            raise ValueError(
                f"RLHFDataset: {str(file)!r} has no column {column!r} (columns: {table.column_names}); "
                f"regenerate it with `{PREPROCESS_HINT}` or set data.prompt_key"
            )
    rows = table.to_pylist()
    bad = next((i for i, r in enumerate(rows) if not isinstance(r["reward_model"], dict)
                or r["reward_model"].get("ground_truth") is None), None)
    if bad is not None:
        raise ValueError(f"RLHFDataset: {str(file)!r} row {bad} has no reward_model.ground_truth (the answer the "
                         f"reward rule checks); regenerate it with `{PREPROCESS_HINT}`")
    return rows


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids, attention_mask) [B, longest], left-padded: every row ends at the last column."""
    width = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, width - len(seq):] = 1
    return input_ids, attention_mask


def collate(rows: Sequence[dict[str, Any]], tokenizer, max_prompt_length: int, image_processor=None) -> DataProto:
    """Left-pad the prompts to the longest in the batch.

    batch: input_ids, attention_mask, position_ids (cumsum(mask) - 1, clipped at 0), all [B, L] int64; with
    images, pixel_values and image_grid_thw (data/images.pixel_batch).
    non_tensor_batch: data_source, reward_model, extra_info, raw_prompt, (multi-turn) tools, (images) images,
    index, and a fresh `uid` per prompt (GRPO/RLOO group id; DataProto.repeat(n) copies it to the n responses)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    lengths = [len(r["input_ids"]) for r in rows]
    if max(lengths) > max_prompt_length:
        raise ValueError(f"collate: a prompt has {max(lengths)} tokens > max_prompt_length={max_prompt_length}")
    input_ids, attention_mask = left_pad([r["input_ids"] for r in rows], pad_id)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    keys = ("data_source", "reward_model", "extra_info", "raw_prompt") + \
        tuple(k for k in ("tools", IMAGES) if k in rows[0])
    non_tensors = {key: [r[key] for r in rows] for key in keys}
    non_tensors["index"] = np.array([r["index"] for r in rows], dtype=np.int64)
    non_tensors["uid"] = [str(uuid.uuid4()) for _ in rows]
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    if IMAGES in rows[0] and image_processor is not None:
        tensors.update(pixel_batch([r[IMAGES] for r in rows], image_processor) or {})
    return DataProto.from_dict(tensors, non_tensors)
