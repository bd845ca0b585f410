"""Experiment tracking: one `Tracking` object fans each step's metrics out to several backends.

Backends (pick with `backends=`):
- "console": one compact rich line per step, floats with 4 significant digits: the `console_keys` given
  (label, key; those logged that step), then how many more went to the other backends; without
  console_keys every key, sorted;
- "jsonl": `<output_dir>/metrics.jsonl`, one JSON object `{"step": step, **metrics}` per `log` call,
  flushed at once so a crash loses nothing. JSON has no NaN/Infinity, so non-finite values are
  written as `null`; `read_metrics` turns them back into NaN (the sign of an infinity is lost);
- "tensorboard": `torch.utils.tensorboard.SummaryWriter(<output_dir>/tensorboard)`, flushed per call;
- "wandb": offline run under `output_dir` (needs `pip install wandb`).

`config` (if given) is written to `<output_dir>/config.json` at start. `resume_step`: a run that resumes
from step k keeps its log one clean series: metrics.jsonl rows of steps > k are dropped (they are
redone) and TensorBoard purges its events from step k + 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["Tracking", "read_metrics", "VALID_BACKENDS"]

VALID_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")


def _scalar(key: str, value: Any) -> int | float:
    """A python int/float from a python / numpy / torch scalar (bools become ints)."""
    if hasattr(value, "item") and callable(value.item):  # torch tensors, numpy scalars and arrays
        size = getattr(value, "size", None)
        numel = value.numel() if hasattr(value, "numel") else (size if isinstance(size, int) else 1)
        if numel != 1:
            raise ValueError(f"metric {key!r} must be a scalar, got a tensor/array with {numel} elements")
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def _fmt(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _plain_config(config: Any) -> Any:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    try:  # an OmegaConf DictConfig
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return config


class Tracking:
    """Log `{name: number}` per step to console / jsonl / tensorboard / wandb. Also a context manager."""

    def __init__(
        self,
        project: str,
        experiment: str,
        output_dir: str | Path,
        backends: str | Iterable[str] = ("console", "jsonl", "tensorboard"),
        config: Mapping[str, Any] | None = None,
        console: Any = None,
        resume_step: int | None = None,
        console_keys: Iterable[tuple[str, str]] | None = None,
    ) -> None:
        names = [backends] if isinstance(backends, str) else list(backends)
        unknown = [b for b in names if b not in VALID_BACKENDS]
        if unknown:
            raise ValueError(f"unknown tracking backend(s) {unknown}; valid: {', '.join(VALID_BACKENDS)}")
        self.backends = tuple(dict.fromkeys(names))
        self.project, self.experiment = project, experiment
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.closed = False
        config = _plain_config(config)

        self._wandb = None
        if "wandb" in self.backends:  # first, so a missing wandb fails before any file is opened
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    "tracking backend 'wandb' needs wandb: pip install wandb, or drop 'wandb' from backends"
                ) from e
            self._wandb = wandb.init(
                project=project, name=experiment, dir=str(self.output_dir), mode="offline", config=config
            )

        if config is not None:
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            (self.output_dir / "config.json").write_text(text + "\n")

        self._console = None
        if "console" in self.backends:
            if console is None:
                from rich.console import Console

                console = Console()
            self._console = console
        self.console_keys = None if console_keys is None else list(console_keys)

        self._jsonl = None
        self.metrics_path = self.output_dir / "metrics.jsonl"
        if resume_step is not None:  # steps after the checkpoint are redone: their old rows go
            _truncate_jsonl(self.metrics_path, resume_step)
        if "jsonl" in self.backends:
            self._jsonl = open(self.metrics_path, "a", encoding="utf-8")

        self._tb = None
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events of the steps a resumed run logs again
            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics to every backend."""
        if self.closed:
            raise RuntimeError("Tracking.log called after close()")
        values = {str(k): _scalar(str(k), v) for k, v in metrics.items()}
        step = int(step)
        if self._console is not None:
            from rich.text import Text

            line = Text(f"step {step}", style="bold")
            shown = [(k, k) for k in sorted(values)] if self.console_keys is None else \
                [(label, k) for label, k in self.console_keys if k in values]
            for label, k in shown:
                line.append(" | ", style="dim")
                line.append(f"{label}=", style="cyan")
                line.append(_fmt(values[k]))
            if len(shown) < len(values):
                others = [b for b in ("jsonl", "tensorboard", "wandb") if b in self.backends]
                line.append(f"  (+{len(values) - len(shown)} more" + (f" in {', '.join(others)})" if others else ")"),
                            style="dim")
            self._console.print(line, soft_wrap=True)
        if self._jsonl is not None:
            row = {"step": step}
            row.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
            self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        """Flush and close every backend (safe to call twice)."""
        if self.closed:
            return
        self.closed = True
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> "Tracking":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the rows of steps <= last_step (atomically: temp file, then rename)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl (or the output dir holding one) back; `null` values become NaN."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append({k: (math.nan if v is None else v) for k, v in json.loads(line).items()})
    return rows
