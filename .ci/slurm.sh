#!/usr/bin/env bash
# A single-node SLURM on this machine, for the SLURM end-to-end test (tests/test_slurm_e2e.py).
#
#   .ci/slurm.sh install   apt-get install slurm-wlm munge (root; Debian/Ubuntu)
#   .ci/slurm.sh start     write slurm.conf + gres.conf, start munged, slurmctld, slurmd as plain daemons
#   .ci/slurm.sh stop      stop the daemons this script started, by the PIDs it recorded
#   .ci/slurm.sh status    exit 0 when the node answers `sinfo` and is idle/mixed/allocated
#
# No systemd: daemons run in the background and their PIDs go to $SLURM_STATE_DIR/*.pid.
# GPUs without GPUs: `Gres=gpu:2` with a gres.conf pointing at two empty files, so that GPU rules are
# scheduled (--gpus / --gres) exactly as on a cluster while no device is ever opened.
set -euo pipefail

STATE=${SLURM_STATE_DIR:-/var/tmp/dflash-slurm}
CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
FAKE_GPUS=${SLURM_FAKE_GPUS:-2}
GPU_TYPE=${SLURM_FAKE_GPU_TYPE:-h100}      # the gpu_model that profiles/slurm asks for
# The node advertises the resources of a small GPU node (SlurmdParameters=config_overrides lets slurmd
# accept more than the machine has; nothing enforces them with proctrack/linuxproc + task/none), so the
# profile's per-rule memory requests schedule here as they would on a cluster.
FAKE_CPUS=${SLURM_FAKE_CPUS:-8}
FAKE_MEM_MB=${SLURM_FAKE_MEM_MB:-262144}
HOST=$(hostname)

log() { echo "[slurm.sh] $*" >&2; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        log "must run as root (it writes $CONF_DIR and starts daemons)"
        exit 1
    fi
}

cmd_install() {
    need_root
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        log "slurm-wlm and munge already installed"
        return 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
    log "installed $(slurmctld -V)"
}

write_conf() {
    mkdir -p "$CONF_DIR" "$STATE"/{ctld,d,log} "$STATE"/dev
    for ((i = 0; i < FAKE_GPUS; i++)); do touch "$STATE/dev/fakegpu$i"; done
    cat >"$CONF_DIR/slurm.conf" <<EOF
# written by .ci/slurm.sh: a single-node test cluster
ClusterName=dflash-ci
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.txt
MinJobAge=3600
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=$HOST CPUs=$FAKE_CPUS RealMemory=$FAKE_MEM_MB Gres=gpu:$GPU_TYPE:$FAKE_GPUS State=UNKNOWN
# the partitions profiles/slurm names; both on the one node
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=ALL Default=NO MaxTime=INFINITE State=UP
EOF
    echo "NodeName=$HOST Name=gpu Type=$GPU_TYPE File=$STATE/dev/fakegpu[0-$((FAKE_GPUS - 1))]" >"$CONF_DIR/gres.conf"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

cmd_start() {
    need_root
    for b in munged slurmctld slurmd sinfo; do
        command -v "$b" >/dev/null || { log "$b not found: run '$0 install' first"; exit 1; }
    done
    if cmd_status 2>/dev/null; then
        log "already running"
        return 0
    fi
    write_conf
    # munge: a key, a socket directory, and the daemon as the munge user
    if [ ! -s /etc/munge/munge.key ]; then
        mungekey --create --force >/dev/null 2>&1 || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 2>/dev/null
        chown munge:munge /etc/munge/munge.key 2>/dev/null || true
        chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    if ! alive "$STATE/munged.pid"; then
        if id munge >/dev/null 2>&1; then
            su -s /bin/sh munge -c "munged --pid-file=/run/munge/munged.pid" || munged --force
        else
            munged --force
        fi
        sleep 0.5
        cp /run/munge/munged.pid "$STATE/munged.pid"
    fi
    munge -n | unmunge >/dev/null || { log "munge does not work"; exit 1; }
    alive "$STATE/slurmctld.pid" || slurmctld
    alive "$STATE/slurmd.pid" || slurmd
    # wait for the node to register and come up
    for _ in $(seq 1 60); do
        if cmd_status 2>/dev/null; then
            log "SLURM up: $(sinfo -h -N -o '%N %T %G' | head -1)"
            return 0
        fi
        sleep 1
    done
    scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true
    sleep 2
    cmd_status || {
        log "SLURM did not come up; logs follow"
        tail -n 20 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
        exit 1
    }
}

cmd_stop() {
    for name in slurmd slurmctld munged; do
        local pidfile="$STATE/$name.pid"
        if alive "$pidfile"; then
            local pid
            pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
            kill -9 "$pid" 2>/dev/null || true
            log "stopped $name ($pid)"
        fi
        rm -f "$pidfile"
    done
}

cmd_status() {
    command -v sinfo >/dev/null || return 1
    local state
    state=$(timeout 10 sinfo -h -N -o '%T' 2>/dev/null | head -1) || return 1
    case "$state" in
        idle* | mixed* | allocated* | completing*) return 0 ;;
        *) return 1 ;;
    esac
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
