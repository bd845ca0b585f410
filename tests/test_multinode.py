"""Two real Ray nodes on this machine (ray.cluster_utils.Cluster: a head and a second raylet with its own
resources), the tiny PPO job spread across them the way a cluster needs it: the actor at PP2 with
one pipeline stage per node, critic and reference at DP2 across the nodes (TP, the innermost group,
would stay inside a node). The run's metrics equal the one-node run's step for step (same seed, same
layouts), and an async run puts its rollout pool on a node beside the trainer's and still syncs.

The two-node driver is a `megappo train` subprocess joined to the cluster with RAY_ADDRESS, as
slurm/ray_on_slurm.sh runs it; the one-node reference runs in this process on the session's Ray.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_utils import config as _config, nondeterministic, run as _run

REPO = Path(__file__).resolve().parents[1]
LAYOUT = ["resources.nodes=2", "resources.workers_per_node=1",
          "actor.parallel.tp=1", "actor.parallel.pp=2", "actor.parallel.dp=1",
          "critic.parallel.tp=1", "critic.parallel.pp=1", "critic.parallel.dp=2",
          "ref.parallel.tp=1", "ref.parallel.pp=1", "ref.parallel.dp=2",
          "trainer.total_steps=2", "trainer.save_every=0", "trainer.val_every=0"]


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    from megappo.parallel.launch import free_port

    # The nodes' environment exports MASTER_ADDR/PORT, as torchrun-style job scripts do; Ray's workers
    # inherit it. Each group must still get its own rendezvous port (not all of them this one).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={"num_cpus": 2, "include_dashboard": False})
        cluster.add_node(num_cpus=3)  # the second node has room for the async rollout worker too
        cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def _train_on(cluster, cfg, out: Path) -> tuple[list[dict], str]:
    """`megappo train` on the cluster with exactly `cfg` (saved as a YAML file)."""
    from omegaconf import OmegaConf

    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "run.yaml")
    env = dict(os.environ, RAY_ADDRESS=cluster.address, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "train", "--config", str(out / "run.yaml"),
                           "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, proc.stdout


@pytest.mark.long  # 122 s; CI keeps the async test below on the same two-node cluster
def test_two_nodes_match_one_node(ray_session, two_nodes, tiny_assets, data_dir, tmp_path):
    cfg = _config(tiny_assets, data_dir, tmp_path / "one", *LAYOUT[2:], "resources.workers_per_node=2")
    one = _run(cfg)
    assert ray_session.cluster_resources().get("CPU", 0) >= 2  # the reference ran on the one-node session Ray
    two_cfg = _config(tiny_assets, data_dir, tmp_path / "two", *LAYOUT)
    two, log = _train_on(two_nodes, two_cfg, tmp_path / "two")
    placement = next(line for line in log.splitlines() if line.startswith("placement:"))
    assert placement.count("node ") == 2, placement  # the train pool really spans both Ray nodes
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        keys = [k for k in a if not nondeterministic(k) and k != "step"]
        assert set(keys) <= set(b)
        diff = {k: (a[k], b[k]) for k in keys if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-7)}
        assert not diff, diff
        assert b["rollout/weights_fingerprint_ok"] == 1.0


def test_async_rollout_pool_beside_the_trainer(two_nodes, tiny_assets, data_dir, tmp_path):
    cfg = _config(tiny_assets, data_dir, tmp_path / "async", *LAYOUT, "trainer.mode=async",
                  "resources.rollout_workers=1")
    rows, log = _train_on(two_nodes, cfg, tmp_path / "async")
    placement = next(line for line in log.splitlines() if line.startswith("placement:"))
    train_nodes = placement.split(";")[0].count("node ")
    assert train_nodes == 2 and "pool rollout: node" in placement, placement
    assert len(rows) == 2 and all(r["rollout/weights_fingerprint_ok"] == 1.0 for r in rows)
    assert rows[1]["rollout/logprob_diff_max"] > 1e-3  # one step off-policy across the nodes
