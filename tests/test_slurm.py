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


def test_each_ray_node_gets_the_interface_holding_its_address():
    """gloo binds to what the hostname resolves to (127.0.1.1 on a stock /etc/hosts) unless GLOO_SOCKET_IFNAME names
    an interface: ray_on_slurm.sh starts each node's Ray with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = the
    interface holding the address it gave Ray there (slurm/netif.sh), checked against psutil's view of this host;
    and a GPU job activates make install-gpu's venv."""
    import psutil

    addrs = {a.address: name for name, snics in psutil.net_if_addrs().items() for a in snics
             if a.family.name == "AF_INET"}
    assert addrs
    for ip, name in addrs.items():
        got = subprocess.run(["bash", "-c", f"source slurm/netif.sh; iface_of_ip {ip}"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert got == name, (ip, got, name)
    assert subprocess.run(["bash", "-c", "source slurm/netif.sh; iface_of_ip 203.0.113.77"], cwd=REPO,
                          capture_output=True, text=True).stdout == ""
    script = (REPO / "slurm" / "ray_on_slurm.sh").read_text()
    assert 'env "${head_net[@]}" ray start --head' in script and 'env "${net[@]}" ray start --address' in script
    assert "default_env=.venv-gpu" in script


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def test_broken_config_fails_in_preflight_fast(slurm, tmp_path):
    """A bad config must stop the job before any Ray start, with the config's error."""
    rc, log = slurm.sbatch(str(REPO / "slurm/ppo_tiny.sbatch"), cwd=REPO,
                           env={"OVERRIDES": "actor.parallel.tp=3", "LOG_ROOT": str(tmp_path)})
    assert rc != 0, log
    assert "actor.parallel tp*pp = 3 does not divide the pool's 2 workers" in log, log
    assert "config check failed" in log
    assert "ray start" not in log and "Ray cluster up" not in log
    assert not list(tmp_path.glob("*/ray-head-*.log")), "Ray was started despite a failing preflight"


def test_unknown_key_fails_in_preflight(slurm, tmp_path):
    rc, log = slurm.sbatch(str(REPO / "slurm/ppo_tiny.sbatch"), cwd=REPO,
                           env={"OVERRIDES": "trainer.totl_steps=2", "LOG_ROOT": str(tmp_path)})
    assert rc != 0
    assert "unknown config key 'trainer.totl_steps': did you mean trainer.total_steps?" in log, log


def test_cuda_job_without_gpus_is_refused(slurm, tmp_path):
    rc, log = slurm.sbatch(str(REPO / "slurm/ppo_tiny.sbatch"), cwd=REPO,
                           env={"OVERRIDES": "resources.device=cuda", "LOG_ROOT": str(tmp_path)})
    assert rc != 0
    assert "resources.device=cuda but this job has no GPUs (SLURM_GPUS_ON_NODE unset): submit with " \
           "--gpus-per-node=N" in log, log
    assert not list(tmp_path.glob("*/ray-head-*.log"))


# the same check on both ports (ray_on_slurm.sh's one loop); CI runs RAY_PORT's (each job's preflight: ~8 s)
@pytest.mark.parametrize("var", ["RAY_PORT", pytest.param("RAY_CLIENT_PORT", marks=pytest.mark.long)])
def test_ray_port_in_use_is_refused(slurm, tiny_assets, data_dir, tmp_path, var):
    """Another service listening on one of the head's fixed ports: one line naming the variable to
    change, before any Ray start."""
    import socket

    from megappo.parallel.launch import free_port
    from trainer_utils import overrides

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"RAY_PORT": str(free_port()), "RAY_CLIENT_PORT": str(free_port()), var: str(port)}
        rc, log = slurm.sbatch(str(REPO / "slurm/ppo_tiny.sbatch"), cwd=REPO, timeout=300,
                               env={"OVERRIDES": " ".join(overrides(tiny_assets, data_dir, tmp_path / "run")),
                                    "LOG_ROOT": str(tmp_path / "logs"), "RAY_PORT_WAIT_S": "2", **ports})
    assert rc != 0
    assert f"{var}={port} is in use on" in log and f"set {var} to a free port" in log, log
    assert not list(tmp_path.glob("logs/*/ray-head-*.log"))


def _squeue(slurm, fmt: str) -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", fmt], env=slurm.env, capture_output=True, text=True).stdout.split()


def _preempted_and_requeued(slurm, tmp_path, overrides: list[str]) -> tuple[int, str, str]:
    """slurm/ppo_tiny.sbatch with these overrides, preempted: USR1 to the batch script (what
    `--signal=B:USR1@120` sends) once the driver prints its first line, then the requeued job released from
    Slurm's hold and waited for. Returns (exit code, the job's output over both runs, its id).

    The signal goes out when the driver prints its first line (its handlers are in place by then), so it
    lands during start-up whatever the machine's speed: waiting for step 1's metrics left
    under 2 s of a 0.4 s-per-step run to reach the driver, and a run that finished first never requeued."""
    import threading

    from megappo.parallel.launch import free_port

    result = {}

    def submit():
        result["rc"], result["log"] = slurm.sbatch(
            str(REPO / "slurm/ppo_tiny.sbatch"), cwd=REPO, timeout=1200,
            env={"OVERRIDES": " ".join(overrides), "LOG_ROOT": str(tmp_path / "logs"), "RAY_PORT": str(free_port()),
                 "RAY_CLIENT_PORT": str(free_port()), "RAY_NUM_CPUS": "4"})

    job = threading.Thread(target=submit)
    job.start()
    deadline = time.monotonic() + 600

    def driver_up() -> bool:  # `megappo train: sync PPO, N steps, ...`, printed after the handlers are installed
        return any("megappo train: sync" in f.read_text() for f in (tmp_path / "logs").glob("*/train.log"))

    while not driver_up():
        assert time.monotonic() < deadline and job.is_alive(), result.get("log", "")[-3000:]
        time.sleep(0.2)
    (job_id,) = _squeue(slurm, "%i")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm.env, check=True)
    while "PENDING" not in _squeue(slurm, "%T"):  # requeued (Slurm holds a requeued job for 2 min: release it)
        assert time.monotonic() < deadline and job.is_alive(), result.get("log", "")[-3000:]
        time.sleep(0.2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=slurm.env, check=True)
    job.join(timeout=900)
    return result["rc"], result["log"], job_id


def _steps(out) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_job_preempted_in_its_step_is_requeued_and_the_requeue_finds_the_checkpoint(slurm, sync_baseline, tiny_assets,
                                                                                       data_dir, tmp_path):
    """CI's real Slurm job, one node and one step: the bootstrap the 70B job uses (preflight -> Ray via srun ->
    megappo train -> teardown), USR1 to the batch script once the driver is up -> the driver finishes step 1,
    checkpoints, exits 75 -> `scontrol requeue` -> the requeued job runs the whole bootstrap again and its
    megappo train finds step 1's checkpoint: nothing left to train, the export the preempted run never wrote, exit 0.
    Step 1 is the trainer tests' baseline's step 1
    (same config; validation off, which the baseline first runs at step 2). Training on after a requeue (4 steps,
    resumed at step 2 or 3) is the long tier's test below."""
    from trainer_utils import assert_same_steps, overrides

    baseline, _ = sync_baseline
    out = tmp_path / "run"
    rc, log, job_id = _preempted_and_requeued(
        slurm, tmp_path, overrides(tiny_assets, data_dir, out, "trainer.total_steps=1", "trainer.val_every=0"))
    assert rc == 0, log[-3000:]
    assert log.count("preflight OK") == log.count("Ray cluster up") == 2, log[-3000:]  # both runs of the job
    assert "received USR1" in log and f"job {job_id} requeued" in log and "training finished" in log
    assert f"nothing to do: {out}/checkpoints/step_00000001 is step 1 of trainer.total_steps=1" in log, log[-3000:]
    # the preempted run stopped before its export: the requeued one writes it (hf_final was never written)
    assert "the run that trained it was stopped before its export" in log
    assert (out / "hf_final" / "config.json").is_file()
    rows = _steps(out)
    assert [r["step"] for r in rows] == [1]
    assert_same_steps(baseline[:1], [{k: v for k, v in r.items() if k != "step"} for r in rows])


@pytest.mark.long  # 202 s on a busy 2-core machine; CI runs the one-step job above (USR1, exit 75, scontrol requeue,
# the checkpoint found by the requeued run)
def test_preempted_job_requeues_and_finishes_like_an_uninterrupted_run(slurm, sync_baseline, tiny_assets, data_dir,
                                                                       tmp_path):
    """The bootstrap, preempted during start-up as above, with 4 steps: the driver finishes step 1,
    checkpoints, exits 75 -> `scontrol requeue` -> the requeued job resumes and finishes at total_steps with the
    metrics of an uninterrupted run of the same config, step for step."""
    from trainer_utils import assert_same_steps, overrides

    baseline, _ = sync_baseline
    out = tmp_path / "run"
    rc, log, job_id = _preempted_and_requeued(slurm, tmp_path, overrides(tiny_assets, data_dir, out))
    assert rc == 0, log[-3000:]
    assert "preflight OK" in log and "Ray cluster up" in log
    assert "received USR1" in log and f"job {job_id} requeued" in log and "training finished" in log
    rows = _steps(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step once, across both runs of the job
    assert_same_steps(baseline, [{k: v for k, v in r.items() if k != "step"} for r in rows])
    train_log = next((tmp_path / "logs").glob("*/train.log")).read_text()
    assert "USR1" in train_log and "resumed from" in train_log
