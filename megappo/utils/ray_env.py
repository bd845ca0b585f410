"""What a driver process sets before it starts Ray (offline hubs, no usage stats, Ray's auth off), and a Ray
failure as one line. Shared by `megappo train` and what else starts its own Ray (reward.judge.model's engine)."""

from __future__ import annotations

import os


def setup_env() -> None:
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                 "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}.items():
        os.environ.setdefault(k, v)


def one_line(e: BaseException) -> str:
    """A failure as one line: a worker's exception (Ray's RayTaskError) by its cause, first line only."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"
