"""slurm/: shellcheck-clean scripts, and the real bootstrap run by a real one-node Slurm cluster."""

import subprocess
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, missing_binaries

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "slurm").glob("*.sh")) + sorted((REPO / "slurm").glob("*.sbatch"))

pytestmark = pytest.mark.skipif(bool(missing_binaries()),
                                reason=f"needs {missing_binaries()} (make system-deps, as root)")


def test_shellcheck_clean():
    assert any(p.name == "ppo_70b.sbatch" for p in SCRIPTS) and any(p.name == "ray_on_slurm.sh" for p in SCRIPTS)
    res = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=REPO / "slurm")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def test_broken_config_fails_in_preflight_fast(slurm, tmp_path):
    """A bad config must stop the job before any Ray start, within seconds, with the config's error."""
    t0 = time.monotonic()
    rc, log = slurm.sbatch(str(REPO / "slurm/ppo_tiny.sbatch"), cwd=REPO,
                           env={"OVERRIDES": "actor.parallel.tp=3", "LOG_ROOT": str(tmp_path)})
    elapsed = time.monotonic() - t0
    assert rc != 0, log
    assert "actor.parallel tp*pp = 3 does not divide the pool's 2 workers" in log, log
    assert "config check failed" in log
    assert "ray start" not in log and "Ray cluster up" not in log
    assert elapsed < 60, f"preflight took {elapsed:.0f}s"
    assert not list(tmp_path.glob("*/ray-head-*.log")), "Ray was started despite a failing preflight"


def test_unknown_key_fails_in_preflight(slurm, tmp_path):
    rc, log = slurm.sbatch(str(REPO / "slurm/ppo_tiny.sbatch"), cwd=REPO,
                           env={"OVERRIDES": "trainer.totl_steps=2", "LOG_ROOT": str(tmp_path)})
    assert rc != 0
    assert "unknown config key 'trainer.totl_steps': did you mean trainer.total_steps?" in log, log


def test_tiny_ppo_two_steps_through_the_bootstrap(slurm, tmp_path):
    """The same bootstrap the 70B job uses: preflight -> Ray via srun -> megappo train -> teardown."""
    import json
    import socket

    from megappo.data import preprocess_arithmetic
    from megappo.testing import ensure_assets

    ensure_assets(REPO / "assets", demo=True)
    preprocess_arithmetic.main(["--out", str(tmp_path / "data"), "--train-size", "64", "--val-size", "16"])
    out = tmp_path / "run"
    overrides = [
        "trainer.total_steps=2", "trainer.save_every=0", "trainer.val_every=0", f"trainer.output_dir={out}",
        f"data.train_files=[{tmp_path / 'data/arith_train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data/arith_val.parquet'}]",
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, log = slurm.sbatch(str(REPO / "slurm/ppo_tiny.sbatch"), cwd=REPO, timeout=900,
                           env={"OVERRIDES": " ".join(overrides), "LOG_ROOT": str(tmp_path / "logs"),
                                "RAY_PORT": str(port), "RAY_NUM_CPUS": "4"})
    assert rc == 0, log[-3000:]
    assert "preflight OK" in log and "Ray cluster up" in log and "training finished" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "objective/scores" in r] == [1, 2]
    assert list((tmp_path / "logs").glob("*/ray-head-*.log")) and list((tmp_path / "logs").glob("*/train.log"))
