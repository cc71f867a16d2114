#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests and for trying the launch
# path on a laptop: munged, slurmctld and slurmd on loopback, every file (keys,
# sockets, config, state, logs) in one directory that `down` deletes.
#
#   launch/slurm/local_cluster.sh install # as root: the Debian packages, if missing
#   launch/slurm/local_cluster.sh up      # prints: export SLURM_CONF=<dir>/slurm.conf
#   eval "$(launch/slurm/local_cluster.sh env)"
#   sbatch --ntasks=2 ... launch/slurm/train.sbatch ...
#   launch/slurm/local_cluster.sh down
#
# Settings (environment):
#   MOE_JAX_SLURM_DIR   state directory         (default: ${TMPDIR:-/tmp}/moe_jax_slurm)
#   MOE_JAX_SLURM_PORT  slurmctld port; slurmd uses the next one (default: 16817)
#   MOE_JAX_SLURM_CPUS  CPUs the node offers    (default: 8, whatever the machine has)
# Needs the Debian packages slurmctld, slurmd, slurm-client and munge; as root
# `install` and `up` install them with apt-get when they are missing.
set -euo pipefail

DIR="${MOE_JAX_SLURM_DIR:-${TMPDIR:-/tmp}/moe_jax_slurm}"
PORT="${MOE_JAX_SLURM_PORT:-16817}"
CPUS="${MOE_JAX_SLURM_CPUS:-8}"
PACKAGES=(slurmctld slurmd slurm-client munge)

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
    command -v sbatch >/dev/null && command -v munged >/dev/null && return
  [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null ||
    die "SLURM is not installed: apt-get install ${PACKAGES[*]} (as root), then run 'up' again"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null; }
}

write_config() {
  # One node named localhost (resolvable, so jax.distributed can reach the
  # coordinator by the node name SLURM reports); the controller goes by this
  # machine's short hostname, which slurmctld insists on, but listens on loopback.
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=moejax
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/slurmctld
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  mkdir -p "$DIR/munge"
  chmod 700 "$DIR/munge"
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/munge/munge.key"
  munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
}

wait_for_idle_node() {
  for _ in $(seq 60); do
    [[ $(sinfo --noheader --format=%t 2>/dev/null) == idle ]] && return
    sleep 0.5
  done
  tail -n 5 "$DIR"/slurmctld.log "$DIR"/slurmd.log >&2 || true
  die "the node did not come up within 30 s (logs in $DIR)"
}

up() {
  [[ -e $DIR/slurm.conf ]] && die "a cluster is already up in $DIR; run 'down' first"
  install_packages
  mkdir -p "$DIR/slurmctld" "$DIR/slurmd"
  write_config
  export SLURM_CONF="$DIR/slurm.conf"
  start_munge
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF" -N localhost
  wait_for_idle_node
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pid_file() {
  local file=$1
  [[ -s $file ]] || return 0
  local pid
  pid=$(cat "$file")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

down() {
  [[ -e $DIR/slurm.conf ]] || { rm -rf "$DIR"; return; }
  export SLURM_CONF="$DIR/slurm.conf"
  scancel --full --quiet --signal=KILL --user="$(id -un)" 2>/dev/null || true
  stop_pid_file "$DIR/slurmd.pid"
  stop_pid_file "$DIR/slurmctld.pid"
  stop_pid_file "$DIR/munge/munged.pid"
  rm -rf "$DIR"
}

case "${1:-}" in
  install) install_packages ;;
  up) up ;;
  down) down ;;
  env) [[ -e $DIR/slurm.conf ]] || die "no cluster is up in $DIR"; echo "export SLURM_CONF=$DIR/slurm.conf" ;;
  *) die "usage: local_cluster.sh install|up|down|env (got '${1:-}')" ;;
esac
