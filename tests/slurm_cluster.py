"""A real one-node Slurm cluster (Debian's slurmctld + slurmd, installed by `make system-deps`) in a
fresh temporary state dir: no /etc edits, no systemd, auth/none. Used by tests/test_slurm.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from megappo.parallel.launch import free_port  # outside the ephemeral range, like every rendezvous port

# MinJobAge=4: `sbatch --wait` polls after 2 s, then multiplies its sleep by 4 while it is under
# MinJobAge/2 and 32 s (slurm's src/sbatch/sbatch.c `_job_wait`): with the default 300 a 3 s job is seen
# done after 10 s and a 60 s job up to 32 s late; at 4 it polls every 2 s (finished jobs are purged >= 4 s
# after they end, on slurmctld's purge pass, after sbatch's next poll).
CONF = """\
ClusterName=megappo-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=4
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing_binaries() -> list[str]:
    return [b for b in ("slurmctld", "slurmd", "sbatch", "sinfo", "shellcheck") if shutil.which(b) is None]


class SlurmCluster:
    def __init__(self, workdir: Path):
        self.dir = Path(workdir)
        self.procs: list[subprocess.Popen] = []
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self, timeout: float = 30.0) -> "SlurmCluster":
        (self.dir / "state").mkdir(parents=True, exist_ok=True)
        (self.dir / "spool").mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        ctld_port = free_port()
        self.conf.write_text(CONF.format(host=host, dir=self.dir, cpus=os.cpu_count() or 1,
                                         ctld_port=ctld_port, d_port=free_port()))
        for daemon in ("slurmctld", "slurmd"):
            log = open(self.dir / f"{daemon}.out", "w")
            self.procs.append(subprocess.Popen([daemon, "-D", "-f", str(self.conf)], env=self.env,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Slurm did not come up in {timeout}s; see {self.dir}/slurmctld.log and slurmd.log")

    def sbatch(self, script: str, *args: str, env: dict | None = None, cwd: str | Path | None = None,
               timeout: float = 900.0) -> tuple[int, str]:
        """`sbatch --wait` a script; returns (exit code, the job's output file text)."""
        out_file = self.dir / f"job-{time.monotonic_ns()}.out"
        job_env = dict(self.env, **(env or {}))
        res = subprocess.run(["sbatch", "--wait", f"--output={out_file}", *args, script], env=job_env, cwd=cwd,
                             capture_output=True, text=True, timeout=timeout)
        text = out_file.read_text() if out_file.exists() else ""
        return res.returncode, text + res.stderr

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()
