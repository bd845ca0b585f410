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
