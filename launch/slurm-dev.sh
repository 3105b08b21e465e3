#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for development and the tests of
# `crucible slurm` (tests/test_slurm.py). Needs root and the OS's packages
# (Debian/Ubuntu apt). No systemd: the daemons run in the foreground (-D) in
# the background of this script, and their pids are kept in the state dir.
#
#   bash launch/slurm-dev.sh up       # install (once), write the config, start munged, slurmctld, slurmd
#   bash launch/slurm-dev.sh status   # exit 0 when the node answers and is idle/mixed/allocated
#   bash launch/slurm-dev.sh down     # cancel its jobs, then stop the daemons this script started (by their pids)
#
# Idempotent: `up` on a running cluster does nothing; `down` on a stopped one
# neither. The config is /etc/slurm/slurm.conf, written only when it is
# absent or was written by this script (first line), so a real cluster's
# config is never touched. Settings (measured on a 2-core machine):
#   ProctrackType=proctrack/linuxproc, TaskPlugin=task/none   (no cgroups in a container)
#   SelectType=select/cons_tres, CPUs=16 + SlurmdParameters=config_overrides,
#   OverSubscribe=FORCE:40                                    (40 one-CPU jobs share the cores)
#   SchedulerParameters=batch_sched_delay=0,sched_min_interval=0  (a burst of jobs starts within ~1 s)
#   AuthInfo=cred_expire=10                                   (a requeued job is held cred_expire + 1 s)
#   AccountingStorageType=accounting_storage/none             (no slurmdbd: sacct fails, squeue/scontrol work)
set -euo pipefail

STATE=${CRUCIBLE_SLURM_DEV_STATE:-/var/lib/crucible-slurm-dev}
CONF=/etc/slurm/slurm.conf
MARK="# written by crucible launch/slurm-dev.sh"
CPUS=${CRUCIBLE_SLURM_DEV_CPUS:-16}

die() { echo "slurm-dev: $*" >&2; exit 1; }

running() {   # running NAME: the daemon this script started is alive (its pid, still that program)
    local f="$STATE/$1.pid" pid
    [ -f "$f" ] || return 1
    pid=$(cat "$f")
    kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
            && command -v munged >/dev/null; then
        return
    fi
    [ "$(id -u)" = 0 ] || die "not root: cannot install slurm (apt-get install slurmctld slurmd slurm-client munge)"
    command -v apt-get >/dev/null || die "no apt-get: install slurmctld, slurmd, slurm-client and munge yourself"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
        || die "apt-get install slurmctld slurmd slurm-client munge failed"
}

write_config() {
    local host
    host=$(hostname -s)
    mkdir -p /etc/slurm "$STATE" "$STATE/ctld" "$STATE/d" /var/log/slurm /run/munge
    if [ -f "$CONF" ] && [ "$(head -n1 "$CONF")" != "$MARK" ]; then
        die "$CONF exists and was not written by this script: not touching a real cluster's config"
    fi
    cat > "$CONF.tmp" <<EOF
$MARK
ClusterName=crucible-dev
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.daemon.pid
SlurmdPidFile=$STATE/slurmd.daemon.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=300
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:40
EOF
    mv "$CONF.tmp" "$CONF"
}

start_munge() {
    if running munged || munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown root:root /etc/munge/munge.key /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || true
    chmod 0400 /etc/munge/munge.key
    chmod 0700 /etc/munge
    # -F: foreground (we background it); --force: root-owned dirs are fine here.
    setsid munged -F --force >"$STATE/munged.out" 2>&1 < /dev/null &
    echo $! > "$STATE/munged.pid"
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    die "munged did not come up (see $STATE/munged.out)"
}

node_ready() {
    local st
    st=$(sinfo -h -N -o '%T' 2>/dev/null | head -n1) || return 1
    case "$st" in idle*|mixed*|allocated*|completing*) return 0 ;; *) return 1 ;; esac
}

up() {
    install_packages
    write_config
    start_munge
    if ! running slurmctld; then
        # -c: a fresh controller forgets the jobs of an earlier (dev) session
        setsid slurmctld -D -c >"$STATE/slurmctld.out" 2>&1 < /dev/null &
        echo $! > "$STATE/slurmctld.pid"
    fi
    if ! running slurmd; then
        setsid slurmd -D >"$STATE/slurmd.out" 2>&1 < /dev/null &
        echo $! > "$STATE/slurmd.pid"
    fi
    for _ in $(seq 300); do
        if node_ready; then
            echo "slurm-dev: one-node cluster up ($(hostname -s), $CPUS CPUs, partition debug)"
            return
        fi
        # A node left DOWN/DRAIN by an earlier stop comes back at once.
        scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
        sleep 0.1
    done
    die "the node did not become ready in 30 s (see $STATE/*.out and /var/log/slurm/)"
}

stop_one() {   # stop_one NAME: SIGTERM the daemon this script started, SIGKILL after 10 s
    local f="$STATE/$1.pid" pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    if running "$1"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

drain() {   # cancel every job of this cluster and wait (30 s at most) for slurmd to end their steps:
            # stopped first, slurmd left them running for ever (a test's workers outlived its run)
    running slurmctld && running slurmd || return 0
    local ids
    ids=$(squeue -h -o %i 2>/dev/null) || return 0
    [ -n "$ids" ] || return 0
    # shellcheck disable=SC2086
    scancel --signal=KILL $ids 2>/dev/null || true
    # shellcheck disable=SC2086
    scancel $ids 2>/dev/null || true
    for _ in $(seq 300); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && return 0
        sleep 0.1
    done
    echo "slurm-dev: jobs still listed after 30 s: $(squeue -h -o %i | tr '\n' ' ')" >&2
}

down() {
    drain
    stop_one slurmd
    stop_one slurmctld
    stop_one munged
    echo "slurm-dev: stopped"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) node_ready ;;
    *) die "usage: $0 up|status|down" ;;
esac
