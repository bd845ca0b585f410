"""EpochSampler: index batches forever, a fresh permutation (seed + epoch) every epoch, resumable."""

from __future__ import annotations

from typing import Any

import numpy as np


class EpochSampler:
    """`next(sampler)` -> list of row indices.

    Epoch e visits the rows in the order of permutation(seed + e) (or 0..n-1 when not shuffling),
    so training past the dataset size reshuffles (open-instruct's "retrain on the same prompts").
    With drop_last the rows left over at the end of an epoch are skipped. `state_dict()` is
    (epoch, position): a sampler loaded from it yields exactly the batches the saved one would."""

    def __init__(self, num_rows: int, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        if batch_size <= 0:
            raise ValueError(f"EpochSampler: batch_size must be > 0, got {batch_size}")
        if num_rows < (batch_size if drop_last else 1):
            raise ValueError(f"EpochSampler: {num_rows} rows cannot fill one batch of {batch_size} "
                             "(use a bigger dataset or a smaller data.train_batch_size)")
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_rows)

    def _epoch_ended(self) -> bool:
        left = self.num_rows - self.position
        return left <= 0 or (self.drop_last and left < self.batch_size)

    def __iter__(self) -> "EpochSampler":
        return self

    def __next__(self) -> list[int]:
        order = self._order(self.epoch)
        batch = order[self.position:self.position + self.batch_size].tolist()
        self.position += len(batch)
        if self._epoch_ended():
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    @property
    def epoch_float(self) -> float:
        """Epochs done so far, e.g. 2.7 (the "epoch" metric)."""
        return self.epoch + self.position / self.num_rows

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_rows", self.num_rows) != self.num_rows:
            raise ValueError(f"EpochSampler: checkpoint was taken over {state['num_rows']} rows, the dataset now has "
                             f"{self.num_rows}; resume with the same data files and max_prompt_length")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed = int(state.get("seed", self.seed))
