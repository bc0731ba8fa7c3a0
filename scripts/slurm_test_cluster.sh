#!/usr/bin/env bash
# Bring up a real single-node Slurm (Debian's 22.05) cluster with accounting and fake GPUs, on this machine.
#
#   sudo scripts/slurm_test_cluster.sh            # install + configure + start (idempotent; ~1 s when already up)
#   sudo scripts/slurm_test_cluster.sh --check    # same, then sinfo / sacct / a 1-GPU sbatch --wait smoke test
#   sudo scripts/slurm_test_cluster.sh --stop     # stop slurmd, slurmctld, slurmdbd, mariadb, munged
#
# Meant for CI and test machines (root, no systemd, no cgroups): daemons are started directly.
# Environment knobs: SLURM_TEST_GPUS (fake GPU count, default 8), SLURM_TEST_MIN_CPUS (CPUs advertised
# to Slurm, default 16: more than the real cores so several 1-CPU test tasks run at once on a 2-core box;
# scripts/test.sh runs 4 test files side by side, each with up to 4 one-GPU tasks in Slurm at once).
set -euo pipefail

GPUS="${SLURM_TEST_GPUS:-8}"
MIN_CPUS="${SLURM_TEST_MIN_CPUS:-16}"
CLUSTER=slurmrouter
PARTITION=debug
FAKEGPU_DIR=/var/lib/slurm-test/fakegpu
ETC=/etc/slurm
RUN=/run/slurm
LOG=/var/log/slurm
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=slurm-test-only
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
export DEBIAN_FRONTEND=noninteractive

T0=$(date +%s%N)
step() {
    local ms=$(( ($(date +%s%N) - T0) / 1000000 ))
    printf '[slurm_test_cluster %3d.%01ds] %s\n' $((ms / 1000)) $((ms % 1000 / 100)) "$*"
}
die() { echo "[slurm_test_cluster] ERROR: $*" >&2; exit 1; }

# Wait up to $1 seconds for command "${@:2}" to succeed quietly.
wait_for() {
    local timeout=$1; shift
    local deadline=$(( $(date +%s) + timeout ))
    until "$@" >/dev/null 2>&1; do
        (( $(date +%s) < deadline )) || return 1
        sleep 0.2
    done
}

pid_alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {  # stop the daemon whose pid file is $2 (name $1), by its recorded id only
    local name=$1 pidfile=$2
    if pid_alive "$pidfile"; then
        local pid; pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
        step "stopped $name (pid $pid)"
    fi
    rm -f "$pidfile"
}

do_stop() {
    stop_pidfile slurmd "$RUN/slurmd.pid"
    stop_pidfile slurmctld "$RUN/slurmctld.pid"
    stop_pidfile slurmdbd "$RUN/slurmdbd.pid"
    if command -v mysqladmin >/dev/null && mysqladmin ping >/dev/null 2>&1; then
        mysqladmin shutdown && step "stopped mariadb"
    fi
    stop_pidfile munged /run/munge/munged.pid
    step "all daemons stopped"
}

MODE=up
case "${1:-}" in
    "") ;;
    --check) MODE=check ;;
    --stop) MODE=stop ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (use --check, --stop or nothing)" ;;
esac
[[ $(id -u) == 0 ]] || die "must run as root (it installs packages and starts system daemons)"
if [[ $MODE == stop ]]; then do_stop; exit 0; fi

# ---------------------------------------------------------------- packages
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    step "installing ${missing[*]}"
    APT_LOG=/tmp/slurm_test_cluster.apt.log
    apt-get update -qq >"$APT_LOG" 2>&1 || { cat "$APT_LOG"; die "apt-get update failed"; }
    # policy-rc.d: Debian's maintainer scripts must not try to start services (no systemd here).
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$APT_LOG" 2>&1 \
        || { tail -30 "$APT_LOG"; die "apt-get install failed (log: $APT_LOG)"; }
fi
step "packages present (slurm $(dpkg-query -W -f='${Version}' slurmctld))"

# ---------------------------------------------------------------- config files (rewritten only when changed)
HOST=$(hostname -s)
mkdir -p "$ETC" "$RUN" "$LOG" /var/spool/slurmctld /var/spool/slurmd "$FAKEGPU_DIR"
read -r REAL_CPUS REAL_MEM < <(slurmd -C | tr ' ' '\n' | awk -F= '/^CPUs=/{c=$2} /^RealMemory=/{m=$2} END{print c, m}')
CPUS=$(( REAL_CPUS > MIN_CPUS ? REAL_CPUS : MIN_CPUS ))
MEM=$(( REAL_MEM * 9 / 10 ))  # leave room for the daemons and the OS
changed=0
write_if_changed() {  # write stdin to $1 (mode $2) only if the content differs; set changed=1 if so
    local path=$1 mode=$2 tmp; tmp=$(mktemp)
    cat >"$tmp"
    if [[ -f "$path" ]] && cmp -s "$tmp" "$path"; then rm -f "$tmp"; else
        install -m "$mode" "$tmp" "$path"; rm -f "$tmp"; changed=1; step "wrote $path"
    fi
}

for ((i = 0; i < GPUS; i++)); do
    # Slurm only accepts character/block devices as GPU files; major 195 is NVIDIA's.
    [[ -c "$FAKEGPU_DIR/fakegpu$i" ]] || { rm -f "$FAKEGPU_DIR/fakegpu$i"; mknod "$FAKEGPU_DIR/fakegpu$i" c 195 "$i"; }
done

write_if_changed "$ETC/slurm.conf" 644 <<EOF
# Written by scripts/slurm_test_cluster.sh: single-node test cluster with $GPUS fake GPUs.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
# No cgroups in CI sandboxes: track processes by parent pid, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Advertise the CPU count configured below even when the host has fewer cores (tests oversubscribe).
SlurmdParameters=config_overrides
DefMemPerCPU=1000
GresTypes=gpu
ReturnToService=2
JobRequeue=1
# A requeued job may start again cred_expire seconds after its requeue (default 120 s): 5 s (the minimum)
# keeps the requeue tests fast. Job step credentials live as long; plenty on a single node.
AuthInfo=cred_expire=5
# Fast turnaround for tests: schedule on every event, backfill every second, kill quickly.
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1,default_queue_depth=1000
MinJobAge=60
KillWait=5
MessageTimeout=10
InactiveLimit=0
MailProg=/bin/true
SlurmdTimeout=60
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM Gres=gpu:$GPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

write_if_changed "$ETC/gres.conf" 644 <<EOF
NodeName=$HOST Name=gpu File=$FAKEGPU_DIR/fakegpu[0-$((GPUS - 1))]
EOF

write_if_changed "$ETC/slurmdbd.conf" 600 <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
# cgroup.conf must not exist: 22.05 cannot disable its cgroup plugin, and the sandbox has no cgroups.
[[ -e "$ETC/cgroup.conf" ]] && { mv "$ETC/cgroup.conf" "$ETC/cgroup.conf.disabled"; step "moved cgroup.conf aside"; }

# A changed config means running slurm daemons hold stale settings: restart them.
if ((changed)); then
    stop_pidfile slurmd "$RUN/slurmd.pid"
    stop_pidfile slurmctld "$RUN/slurmctld.pid"
    stop_pidfile slurmdbd "$RUN/slurmdbd.pid"
fi

# ---------------------------------------------------------------- daemons, in dependency order
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    if [[ ! -s /etc/munge/munge.key ]]; then  # the package's postinst normally creates it
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
        step "created /etc/munge/munge.key"
    fi
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    munged --force 2>/dev/null || munged --force
    wait_for 10 bash -c 'munge -n | unmunge' || die "munged did not start"
    step "started munged"
fi
step "munge ok"

if ! mysqladmin ping >/dev/null 2>&1; then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    setsid nohup mysqld_safe --user=mysql >"$LOG/mysqld_safe.log" 2>&1 &
    wait_for 60 mysqladmin ping || die "mariadb did not start (see $LOG/mysqld_safe.log)"
    step "started mariadb"
fi
mysql -u root <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
EOF
step "mariadb ok"

if ! pid_alive "$RUN/slurmdbd.pid"; then
    slurmdbd
    wait_for 30 sacctmgr -n list cluster || die "slurmdbd did not answer (see $LOG/slurmdbd.log)"
    step "started slurmdbd"
fi
if [[ -z $(sacctmgr -n -P list cluster "$CLUSTER" format=cluster) ]]; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
    step "registered cluster $CLUSTER in accounting"
fi
step "slurmdbd ok"

if ! pid_alive "$RUN/slurmctld.pid"; then
    slurmctld
    wait_for 30 scontrol ping || die "slurmctld did not answer (see $LOG/slurmctld.log)"
    step "started slurmctld"
fi
if ! pid_alive "$RUN/slurmd.pid"; then
    slurmd
    step "started slurmd"
fi

node_state() { sinfo -h -N -n "$HOST" -o %t 2>/dev/null | head -1; }
node_ready() { [[ $(node_state) =~ ^(idle|mix|alloc)$ ]]; }
if ! wait_for 30 node_ready; then
    # A node left drained/down by an earlier run (e.g. config change) is fine to put back.
    scontrol update nodename="$HOST" state=resume 2>/dev/null || true
    wait_for 15 node_ready || die "node $HOST is '$(node_state)' (see $LOG/slurmd.log, scontrol show node)"
fi
step "node $HOST is $(node_state): CPUs=$CPUS RealMemory=${MEM}MB gpu:$GPUS partition=$PARTITION"

[[ $MODE == check ]] || exit 0

# ---------------------------------------------------------------- smoke test
sinfo
sacct -X -n -S now-1minute >/dev/null || die "sacct failed: accounting is not working"
step "sacct ok (accounting enabled)"
out=$(mktemp -d /tmp/slurm_test_cluster.XXXXXX)
sbatch --wait --quiet --partition="$PARTITION" --gres=gpu:1 --time=1 --output="$out/out" \
    --wrap 'echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"' || die "sbatch --wait failed"
grep -q '^CUDA_VISIBLE_DEVICES=[0-9]$' "$out/out" || die "job did not see one GPU: $(cat "$out/out")"
step "sbatch --wait --gres=gpu:1 ok: $(cat "$out/out")"
rm -rf "$out"
