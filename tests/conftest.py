"""Session-wide test setup: offline env vars set before anything heavy is imported, and the tiny
assets (tokenizer + tiny llama/qwen2/mistral) built once per session under the checkout's assets/."""

import os
from pathlib import Path

# Before torch/vllm/ray are imported anywhere in the session.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_assets() -> dict[str, Path]:
    from megappo.assets import ensure_assets

    return ensure_assets(REPO / "assets")


@pytest.fixture(scope="session")
def demo_assets() -> dict[str, Path]:
    """tiny_assets plus the demo's warm start (tiny-llama-arith, configs/ppo_tiny.yaml's model.path: ~20 s once)."""
    from megappo.assets import ensure_assets

    return ensure_assets(REPO / "assets", demo=True)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole pytest session (each ray.init costs 4-7 s). 8 logical CPUs: a
    trainer run's warm workers (trainer_utils.WARM, up to 4 bundles) stay placed next to another test's groups."""
    import ray

    import trainer_utils

    if not ray.is_initialized():
        # address="local": always a fresh Ray for the session, even when an earlier `ray start` (e.g. the
        # Slurm bootstrap, which never runs `ray stop`) left /tmp/ray/ray_current_cluster behind
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 namespace="megappo-tests")
    yield ray
    print(f"\nwarm trainer workers: {trainer_utils.WARM.reused} runs reused them, {trainer_utils.WARM.started} "
          "started their own")
    trainer_utils.WARM.close()
    ray.shutdown()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The arithmetic task's parquet files (64 train / 8 val prompts) for the trainer tests."""
    from megappo.data.preprocess_arithmetic import main

    out = tmp_path_factory.mktemp("data")
    main(["--out", str(out), "--train-size", "64", "--val-size", "8"])
    return out


@pytest.fixture(scope="session")
def sync_baseline(ray_session, tiny_assets, data_dir, tmp_path_factory):
    """One uninterrupted 4-step sync run of the trainer tests' config, on workers started for it (the warm ones
    of another run are ended first): (its metrics, its output dir). The resume, restart and preemption tests
    must reproduce it step for step, and so must a run on its workers after another run (test_trainer)."""
    from trainer_utils import WARM, config, run

    out = tmp_path_factory.mktemp("sync_baseline")
    WARM.close()
    started = WARM.started
    history = run(config(tiny_assets, data_dir, out))
    assert WARM.started == started + 1  # a fresh start, kept warm for the next run
    return history, out


@pytest.fixture
def fake_teacher():
    """make(*faults): a stand-in teacher server on loopback (distill_helpers.FakeTeacher), closed after the test."""
    from distill_helpers import FakeTeacher

    servers = []

    def make(*faults, slow_s: float = 0.0):
        servers.append(FakeTeacher(faults, slow_s))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture(scope="session")
def served_tiny_llama(tiny_assets):
    """One `megappo serve` of the tiny llama in its own process for the session, (its base URL, its key): the
    judge of test_judge_reward and the teacher of test_distillation ask it with the same settings (one start,
    ~25 s, instead of two; idle in between: ~1.1 GB, no CPU)."""
    from gateway_helpers import serve_process

    key = "k-served"
    with serve_process(tiny_assets["tiny-llama"], "--max-model-len", "256", "--max-tokens", "8", "--kv-cache-mb", "32",
                       key=key) as (_, url):
        yield url, key
