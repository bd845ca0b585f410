"""Prompt data: RLHFDataset over parquet, collate to a left-padded DataProto, EpochSampler, and
preprocess scripts (preprocess_arithmetic, preprocess_gsm8k; from_file: `megappo data`, your own rows) that
write the parquet files."""

from megappo.data.dataset import RLHFDataset, collate
from megappo.data.sampler import EpochSampler

__all__ = ["EpochSampler", "RLHFDataset", "collate"]
