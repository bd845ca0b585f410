#!/usr/bin/env bash
# Shared bootstrap for every slurm/*.sbatch: preflight, Ray on the allocation, `megappo train`, teardown.
#
#   preflight (seconds, before any Ray start): env imports megappo, config validates (model/data paths
#   exist, output dir writable), the planner says the layout fits the GPUs and, with offloaded roles,
#   the head node's RAM
#   -> Ray head on the first node, workers on the others (srun, fixed ports)
#   -> wait (bounded) until every node's GPUs/CPUs are registered
#   -> megappo train on the head; exit non-zero as soon as any srun step dies
#   -> preemption: SIGUSR1 / SIGTERM to this script (Slurm's `--signal=B:USR1@120` before a time limit
#      or preemption; scancel --signal=USR1 --batch) is passed to the driver, which finishes the step in
#      flight, checkpoints and exits 75; the job is then requeued (`scontrol requeue`, needs
#      `#SBATCH --requeue`) and the requeued run resumes from that checkpoint
#   -> teardown on any exit.
#
# Environment (all optional):
#   CONFIG            config YAML (the sbatch file sets its default)
#   OVERRIDES         extra `key=value` overrides, space separated
#   MEGAPPO_ROOT      checkout to run from (default: the directory sbatch was called from)
#   MEGAPPO_ENV       what to activate: a venv dir, or a file to source (module loads, conda, container)
#                     (default: $MEGAPPO_ROOT/.venv-gpu for a job with GPUs, make install-gpu's, else
#                     $MEGAPPO_ROOT/.venv, when it exists)
#   NETWORK_INTERFACE interface whose IPv4 address Ray should use (default: the node's first non-loopback
#                     address). Each node's Ray (and so every worker's gloo and NCCL) gets GLOO_SOCKET_IFNAME /
#                     NCCL_SOCKET_IFNAME = the interface holding the address Ray uses there, unless those are set
#   NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...  NCCL knobs are passed through to every Ray node as set
#   RAY_PORT          head GCS port (default 6379); worker ports use RAY_MIN_WORKER_PORT..RAY_MAX_WORKER_PORT
#                     (default 10002..19999, Ray's own: megappo's rendezvous ports are drawn from 20000 up)
#   RAY_CLIENT_PORT   the head's Ray Client server port (default 10001, Ray's own)
#   RAY_WAIT_S        how long to wait for the cluster to register (default 300)
#   RAY_PORT_WAIT_S   how long a busy head port is retried before the job is refused (default 20)
#   LOG_ROOT          where the job directory with per-node logs goes (default $MEGAPPO_ROOT/outputs/slurm)
#   SKIP_PLAN=1       skip the memory planner (CPU runs)
set -euo pipefail

MEGAPPO_ROOT=${MEGAPPO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$MEGAPPO_ROOT"
: "${CONFIG:?set CONFIG to a config YAML, e.g. CONFIG=configs/ppo_70b.yaml}"
OVERRIDES=${OVERRIDES:-}
RAY_PORT=${RAY_PORT:-6379}
RAY_CLIENT_PORT=${RAY_CLIENT_PORT:-10001}
RAY_MIN_WORKER_PORT=${RAY_MIN_WORKER_PORT:-10002}
RAY_MAX_WORKER_PORT=${RAY_MAX_WORKER_PORT:-19999}
RAY_WAIT_S=${RAY_WAIT_S:-300}
RAY_PORT_WAIT_S=${RAY_PORT_WAIT_S:-20}
JOB_ID=${SLURM_JOB_ID:-local}
JOB_DIR=${LOG_ROOT:-$MEGAPPO_ROOT/outputs/slurm}/${SLURM_JOB_NAME:-megappo}-$JOB_ID
mkdir -p "$JOB_DIR"

log() { echo "[megappo-slurm $(date +%H:%M:%S)] $*"; }
die() { echo "[megappo-slurm] ERROR: $*" >&2; exit 1; }
NNODES=${SLURM_JOB_NUM_NODES:-1}
gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
GPUS_PER_NODE=${gpus##*:}  # "h100:8" -> 8

# ---------- environment ----------
default_env=.venv
if [[ "$GPUS_PER_NODE" -ge 1 && -f "$MEGAPPO_ROOT/.venv-gpu/bin/activate" ]]; then
  default_env=.venv-gpu  # a GPU job runs the GPU stack (make install-gpu), not the CPU one
fi
if [[ -n "${MEGAPPO_ENV:-}" ]]; then
  if [[ -f "$MEGAPPO_ENV/bin/activate" ]]; then
    # shellcheck disable=SC1091
    source "$MEGAPPO_ENV/bin/activate"
  elif [[ -f "$MEGAPPO_ENV" ]]; then
    # shellcheck disable=SC1090
    source "$MEGAPPO_ENV"
  else
    die "MEGAPPO_ENV=$MEGAPPO_ENV is neither a venv dir nor a file to source"
  fi
elif [[ -f "$MEGAPPO_ROOT/$default_env/bin/activate" ]]; then
  # shellcheck disable=SC1090
  source "$MEGAPPO_ROOT/$default_env/bin/activate"
fi

# ---------- preflight: fail in seconds, before any Ray start ----------
read -r -a override_args <<< "$OVERRIDES"
log "preflight: job $JOB_ID, config $CONFIG ${OVERRIDES:+(overrides: $OVERRIDES)}, logs in $JOB_DIR"
python -c "import megappo" 2>"$JOB_DIR/preflight.err" \
  || die "the Python env cannot import megappo ($(tail -n 1 "$JOB_DIR/preflight.err")); set MEGAPPO_ENV or run make install"
# the allocation first (a wrong one wastes the queue wait); an unreadable config is the next check's message
DEVICE=$(python -c "import sys; from megappo.config import load_config; print(load_config(sys.argv[1], sys.argv[2:], validate=False).resources.device)" \
  "$CONFIG" "${override_args[@]}" 2>/dev/null || true)
if [[ "$DEVICE" == cuda && "$GPUS_PER_NODE" -lt 1 ]]; then
  die "resources.device=cuda but this job has no GPUs (SLURM_GPUS_ON_NODE unset): submit with --gpus-per-node=N"
fi
megappo config check --paths --config "$CONFIG" "${override_args[@]}" \
  || die "config check failed (message above); fix $CONFIG or OVERRIDES"
if [[ "${SKIP_PLAN:-0}" != 1 ]]; then
  # host RAM the job may use on a node: its Slurm limit (--mem; 0 = the whole node), else MemTotal
  HOST_MEM_GB=$(awk '/^MemTotal:/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
  if [[ -n "${SLURM_MEM_PER_NODE:-}" && "${SLURM_MEM_PER_NODE}" != 0 ]]; then
    HOST_MEM_GB=$(( SLURM_MEM_PER_NODE / 1024 < HOST_MEM_GB ? SLURM_MEM_PER_NODE / 1024 : HOST_MEM_GB ))
  fi
  megappo plan --config "$CONFIG" --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" --host-mem-gb "$HOST_MEM_GB" \
    "${override_args[@]}" > "$JOB_DIR/plan.txt" 2> "$JOB_DIR/plan.err" \
    || { cat "$JOB_DIR/plan.txt" "$JOB_DIR/plan.err"; die "the planner says this layout does not fit: $(tail -n 1 "$JOB_DIR/plan.err")"; }
fi
log "preflight OK"

# ---------- nodes and head address ----------
mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}")
head_node=${nodes[0]}
node_ip() {  # one IPv4 address of node $1: on NETWORK_INTERFACE when set, else its first non-loopback one
  if [[ -n "${NETWORK_INTERFACE:-}" ]]; then
    srun --nodes=1 --ntasks=1 --overlap -w "$1" ip -4 -o addr show "$NETWORK_INTERFACE" | awk '{print $4}' | cut -d/ -f1 | head -n 1
  else  # `hostname --ip-address` may list several, or 127.0.1.1 from /etc/hosts
    srun --nodes=1 --ntasks=1 --overlap -w "$1" hostname --all-ip-addresses | tr ' ' '\n' \
      | grep -E '^[0-9]+(\.[0-9]+){3}$' | grep -v '^127\.' | head -n 1
  fi
}
# shellcheck source=SCRIPTDIR/netif.sh
source "$MEGAPPO_ROOT/slurm/netif.sh"
# env assignments for a node's `ray start`: its workers' gloo and NCCL on the interface holding the address Ray
# uses there (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME as set win)
collective_env() {  # collective_env NODE IP
  local iface=${NETWORK_INTERFACE:-}
  if [[ -z "$iface" ]]; then
    iface=$(srun --nodes=1 --ntasks=1 --overlap -w "$1" bash -c "source '$MEGAPPO_ROOT/slurm/netif.sh'; iface_of_ip $2")
  fi
  [[ -n "$iface" ]] || die "no interface of node $1 holds $2 (set NETWORK_INTERFACE)"
  echo "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$iface} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$iface}"
}
head_ip=$(node_ip "$head_node")
[[ -n "$head_ip" ]] || die "could not resolve the IP of head node $head_node (set NETWORK_INTERFACE?)"
# The head's fixed ports (GCS, Ray Client server: the head fails on a busy one) must be free = bindable as a
# server binds them (SO_REUSEADDR: TIME_WAIT sockets of a previous run do not count); retried for
# RAY_PORT_WAIT_S seconds, since a requeued job can start while its predecessor's Ray head is still
# exiting. Prints the busy one.
ports_free='
import socket, sys, time
for arg in sys.argv[2:]:
    for _ in range(max(1, int(sys.argv[1]))):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", int(arg.split("=")[1]))); break
            except OSError:
                time.sleep(1)
    else:
        print(arg.split("=")[0]); sys.exit(1)'
if ! busy=$(srun --nodes=1 --ntasks=1 --overlap -w "$head_node" python -c "$ports_free" \
            "$RAY_PORT_WAIT_S" "RAY_PORT=$RAY_PORT" "RAY_CLIENT_PORT=$RAY_CLIENT_PORT" 2>/dev/null); then
  busy=${busy:-RAY_PORT}
  die "$busy=${!busy} is in use on $head_node (another Ray, or another service); set $busy to a free port"
fi
export RAY_ADDRESS="$head_ip:$RAY_PORT"
net_line=$(collective_env "$head_node" "$head_ip")  # (a failure there ends the job: set -e)
read -r -a head_net <<< "$net_line"
log "head $head_node ($head_ip, ${head_net[*]}), ${#nodes[@]} node(s): ${nodes[*]}"

# ---------- teardown on any exit ----------
step_pids=()
stop_ray() {
  # SIGTERM to each srun step reaches its `ray start --block`, which stops the Ray processes it
  # started (and Slurm reaps the step). No `ray stop`: it would kill every Ray on a shared node.
  for pid in "${step_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  step_pids=()
}
cleanup() {
  local rc=$?
  log "teardown (exit code $rc)"
  stop_ray
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# ---------- Ray: head, then workers, one srun step per node ----------
ray_args=(--min-worker-port="$RAY_MIN_WORKER_PORT" --max-worker-port="$RAY_MAX_WORKER_PORT"
          --include-dashboard=false --disable-usage-stats --block)
cpus_per_node=${RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
res_args=(--num-cpus="$cpus_per_node" --num-gpus="$GPUS_PER_NODE")
srun --nodes=1 --ntasks=1 --overlap -w "$head_node" \
  env "${head_net[@]}" ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" \
    --ray-client-server-port="$RAY_CLIENT_PORT" \
    "${ray_args[@]}" "${res_args[@]}" \
  > "$JOB_DIR/ray-head-$head_node.log" 2>&1 &
step_pids+=($!)
steps_alive() {
  for pid in "${step_pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { log "srun step $pid died; see $JOB_DIR/ray-*.log"; return 1; }
  done
}
# the head's GCS accepting connections (the port was free above: it is this job's) before workers join it, and
# before any Ray client polls it (each poll below is a Python start, on the cores `ray start` is using)
deadline=$((SECONDS + RAY_WAIT_S))
until (exec 3<>"/dev/tcp/$head_ip/$RAY_PORT") 2>/dev/null; do
  steps_alive || die "the Ray head's srun step died during startup; see $JOB_DIR/ray-head-$head_node.log"
  (( SECONDS < deadline )) \
    || die "the Ray head's GCS ($RAY_ADDRESS) did not open in ${RAY_WAIT_S}s; see $JOB_DIR/ray-head-$head_node.log"
  sleep 0.5
done
for node in "${nodes[@]:1}"; do
  ip=$(node_ip "$node")
  [[ -n "$ip" ]] || die "could not resolve the IP of node $node (set NETWORK_INTERFACE?)"
  net_line=$(collective_env "$node" "$ip")
  read -r -a net <<< "$net_line"
  log "node $node ($ip, ${net[*]})"
  srun --nodes=1 --ntasks=1 --overlap -w "$node" \
    env "${net[@]}" ray start --address="$RAY_ADDRESS" --node-ip-address="$ip" "${ray_args[@]}" "${res_args[@]}" \
    > "$JOB_DIR/ray-worker-$node.log" 2>&1 &
  step_pids+=($!)
done


# ---------- wait until every node's resources are registered (bounded) ----------
want_gpus=$((NNODES * GPUS_PER_NODE))
want_cpus=$((NNODES * cpus_per_node))
while :; do
  steps_alive || die "a Ray srun step died during startup"
  have=$(python - <<'PY' 2>/dev/null || echo "0 0"
import ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
r = ray.cluster_resources()
print(int(r.get("GPU", 0)), int(r.get("CPU", 0)))
PY
)
  read -r have_gpus have_cpus <<< "$have"
  if (( have_gpus >= want_gpus && have_cpus >= want_cpus )); then break; fi
  (( SECONDS < deadline )) || die "Ray cluster incomplete after ${RAY_WAIT_S}s: $have_gpus/$want_gpus GPUs, $have_cpus/$want_cpus CPUs registered"
  sleep 3
done
log "Ray cluster up: $have_gpus GPUs, $have_cpus CPUs"

# ---------- train; stop at once if any srun step dies; pass preemption signals on ----------
EXIT_PREEMPTED=75  # megappo train: checkpointed after SIGTERM / SIGUSR1, resume by running it again
megappo train --config "$CONFIG" "${override_args[@]}" > >(tee -a "$JOB_DIR/train.log") 2>&1 &
train_pid=$!
preempt() {
  log "received $1: the driver finishes its step, checkpoints and stops"
  kill "-$1" "$train_pid" 2>/dev/null || true
}
trap 'preempt USR1' USR1
trap 'preempt TERM' TERM
while kill -0 "$train_pid" 2>/dev/null; do
  if ! steps_alive; then
    kill "$train_pid" 2>/dev/null || true
    die "a Ray node's srun step died during training; see $JOB_DIR"
  fi
  sleep 1 & wait $! || true  # in the background: a signal's trap runs at once, not after the sleep
done
trap '' USR1 TERM  # the driver has exited: the requeue's own SIGTERM (it cancels this run) lets the teardown finish
rc=0
wait "$train_pid" || rc=$?
if [[ "$rc" == "$EXIT_PREEMPTED" ]]; then
  # Ray stopped first: the requeue cancels every step still running, and a step whose srun is gone holds the
  # requeue ~10 s (its exit message to srun refused and retried)
  stop_ray
  if [[ -n "${SLURM_JOB_ID:-}" ]] && scontrol requeue "$SLURM_JOB_ID"; then
    log "preempted: checkpoint written, job $SLURM_JOB_ID requeued (restart ${SLURM_RESTART_COUNT:-0}); it resumes there"
    exit 0
  fi
  die "preempted: checkpoint written, but the job could not be requeued (submit with --requeue); resubmit to resume"
fi
[[ "$rc" == 0 ]] || die "megappo train exited with $rc; see $JOB_DIR/train.log"
log "training finished"
