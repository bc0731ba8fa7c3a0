#!/usr/bin/env bash
# Bring up a multi-node Slurm test cluster on this one machine, beside (never touching) the single-node
# cluster of scripts/slurm_test_cluster.sh: its own slurmctld (own ports, state, ClusterName, config under
# /etc/slurm-multinode) and N slurmd "nodes", each in its own network + UTS namespace (hostname mn<i>),
# joined to the controller by veth pairs on a bridge with private addresses this script creates and removes.
#
#   sudo scripts/slurm_multinode_cluster.sh --nodes 2   # up (idempotent, ~2 s; ~0.7 s when up); --nodes defaults to 2
#   sudo scripts/slurm_multinode_cluster.sh --check     # up, then sinfo, `srun -N<nodes>` and a gloo all_reduce
#                                                       # (needs the packages, munged, slurmdbd: slurm_test_cluster.sh)
#   sudo scripts/slurm_multinode_cluster.sh --stop      # stop its daemons, remove namespaces, links, files
#
# Clients talk to it with   export SLURM_CONF=/etc/slurm-multinode/slurm.conf   (sinfo, sbatch, srun, sacct).
# Network: bridge slmnbr0 10.231.0.1/24 in the root namespace (the controller's address); node i is netns
# slmn-n<i>, hostname mn<i>, address 10.231.0.(10+i) on its eth0; /etc/netns/slmn-n<i>/hosts names them all.
# Environment knobs: SLURM_MN_GPUS (fake GPUs per node, default 2), SLURM_MN_CPUS (CPUs per node, default 4),
# SLURM_MN_ACCOUNTING (1: share the single-node cluster's slurmdbd under ClusterName slurmmn, default 1),
# SLURM_MN_SUBNET (the private /24's first three octets, default 10.231.0).
set -euo pipefail

NODES=2
GPUS="${SLURM_MN_GPUS:-2}"
CPUS="${SLURM_MN_CPUS:-4}"
ACCOUNTING="${SLURM_MN_ACCOUNTING:-1}"
CLUSTER=slurmmn
PARTITION=mn
URGENT=mnurgent   # a higher-priority partition whose jobs preempt those of $PARTITION
CTL_PORT=6917
SLURMD_PORT=6918
SUBNET="${SLURM_MN_SUBNET:-10.231.0}"   # a /24 nothing else on the machine routes
CTL_ADDR=$SUBNET.1
BRIDGE=slmnbr0
ETC=/etc/slurm-multinode
RUN=/run/slurm-mn
STATE=/var/lib/slurm-mn
LOG=/var/log/slurm-mn
CONF=$ETC/slurm.conf

T0=$(date +%s%N)
step() {
    local ms=$(( ($(date +%s%N) - T0) / 1000000 ))
    printf '[slurm_multinode %3d.%01ds] %s\n' $((ms / 1000)) $((ms % 1000 / 100)) "$*"
}
die() { echo "[slurm_multinode] ERROR: $*" >&2; exit 1; }
wait_for() {  # wait up to $1 seconds for "${@:2}" to succeed quietly
    local timeout=$1; shift
    local deadline=$(( $(date +%s) + timeout ))
    until "$@" >/dev/null 2>&1; do
        (( $(date +%s) < deadline )) || return 1
        sleep 0.3
    done
}
pid_alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop_pid() {  # stop process $2 (name $1) by its id: TERM, then KILL after 5 s
    local name=$1 pid=$2
    kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    step "stopped $name (pid $pid)"
}
netns_of() { echo "slmn-n$1"; }
node_of() { echo "mn$1"; }
addr_of() { echo "$SUBNET.$((10 + $1))"; }
mn() { SLURM_CONF=$CONF "$@"; }  # a Slurm client command against this cluster

# Indices of nodes this script may have made (from the namespaces that exist, so --stop needs no --nodes).
existing_nodes() { ip netns list 2>/dev/null | awk '{print $1}' | sed -n 's/^slmn-n\([0-9]\+\)$/\1/p'; }

remove_node() {  # stop every process in node $1's namespace (all started by its slurmd), then remove it
    local i=$1 ns pids; ns=$(netns_of "$i")
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    if [[ -n $pids ]]; then
        kill $pids 2>/dev/null || true
        for _ in $(seq 30); do [[ -z $(ip netns pids "$ns" 2>/dev/null) ]] && break; sleep 0.1; done
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' '); [[ -z $pids ]] || kill -9 $pids 2>/dev/null || true
        step "stopped the processes in $ns (slurmd, its steps and tasks)"
    fi
    ip link del "slmn${i}h" 2>/dev/null || true   # deleting one end of a veth removes both
    ip netns del "$ns" && step "removed netns $ns"
    rm -rf "/etc/netns/$ns" "$RUN/slurmd-$(node_of "$i").pid"
}

no_jobs() { [[ -z $(mn squeue -h -o %i 2>/dev/null) ]]; }
do_stop() {
    local i
    if pid_alive "$RUN/slurmctld.pid" && [[ -n $(mn squeue -h -o %i 2>/dev/null) ]]; then
        mn scancel --full $(mn squeue -h -o %i)  # only this cluster's jobs; ends them in accounting too
        wait_for 15 no_jobs || true
        step "cancelled this cluster's jobs"
    fi
    for i in $(existing_nodes); do remove_node "$i"; done
    if pid_alive "$RUN/slurmctld.pid"; then stop_pid slurmctld "$(cat "$RUN/slurmctld.pid")"; fi
    rmdir /etc/netns 2>/dev/null || true
    if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE" && step "removed bridge $BRIDGE"; fi
    if [[ $ACCOUNTING == 1 ]] && command -v sacctmgr >/dev/null \
        && [[ -n $(sacctmgr -n -P list cluster "$CLUSTER" format=cluster 2>/dev/null) ]]; then
        if sacctmgr -i delete cluster "$CLUSTER" >/dev/null 2>&1; then step "removed cluster $CLUSTER from accounting"
        else step "left cluster $CLUSTER in accounting (it still lists running jobs; the next start ends them)"; fi
    fi
    rm -rf "$ETC" "$RUN" "$STATE"
    step "multi-node cluster stopped and removed (logs kept in $LOG)"
}

MODE=up
while (($#)); do
    case "$1" in
        --nodes) NODES=${2:?--nodes needs a number}; shift ;;
        --nodes=*) NODES=${1#--nodes=} ;;
        --check) MODE=check ;;
        --stop) MODE=stop ;;
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (use --nodes N, --check, --stop)" ;;
    esac
    shift
done
[[ $(id -u) == 0 ]] || die "must run as root (it creates network namespaces and starts daemons)"
[[ $NODES =~ ^[1-9]$ ]] || die "--nodes must be 1..9, got '$NODES'"
if [[ $MODE == stop ]]; then do_stop; exit 0; fi

command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    || die "Slurm is not installed: run scripts/slurm_test_cluster.sh first (it installs the packages)"
munge -n 2>/dev/null | unmunge >/dev/null 2>&1 \
    || die "munged is not running: run scripts/slurm_test_cluster.sh first (this script shares its munge)"
if ! command -v ip >/dev/null; then  # iproute2 (namespaces, veth, bridge): not in every minimal image
    install_ip() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null 2>&1; }
    install_ip || { apt-get update -qq >/dev/null 2>&1 && install_ip; } || die "no 'ip' command: apt-get install iproute2"
fi
step "slurm $(dpkg-query -W -f='${Version}' slurmctld), munge ok"

# ---------------------------------------------------------------- network: bridge + one netns per node
# The subnet must be free: no route to it but (on a re-run) the bridge's own. Checked before any change.
route=$(ip -4 route show to match "$CTL_ADDR" | awk '$1 != "default" && !/ dev '"$BRIDGE"' /')
[[ -z $route ]] || die "$SUBNET.0/24 is already in use here ($route): set SLURM_MN_SUBNET to a free /24"
if ip link show "$BRIDGE" >/dev/null 2>&1 && [[ $(ip -4 addr show dev "$BRIDGE") != *"inet $CTL_ADDR/24"* ]]; then
    do_stop  # left by a run with another SLURM_MN_SUBNET: start clean
fi
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge || die "cannot create bridge $BRIDGE (no CAP_NET_ADMIN?)"
fi
[[ $(ip addr show dev "$BRIDGE") == *"inet $CTL_ADDR/"* ]] || ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
ip link set "$BRIDGE" up

for i in $(existing_nodes); do ((i <= NODES)) || remove_node "$i"; done  # left from a larger --nodes
HOSTS=$(mktemp)
{ echo "127.0.0.1 localhost"; echo "$CTL_ADDR $(hostname -s)"
  for ((i = 1; i <= NODES; i++)); do echo "$(addr_of "$i") $(node_of "$i")"; done; } >"$HOSTS"
for ((i = 1; i <= NODES; i++)); do
    ns=$(netns_of "$i")
    [[ -e /run/netns/$ns ]] || ip netns add "$ns"
    if ! ip link show "slmn${i}h" >/dev/null 2>&1; then
        ip link add "slmn${i}h" type veth peer name "slmn${i}n"
        ip link set "slmn${i}n" netns "$ns"
        ip -n "$ns" link set "slmn${i}n" name eth0
    fi
    ip link set "slmn${i}h" master "$BRIDGE"
    ip link set "slmn${i}h" up
    [[ $(ip -n "$ns" addr show dev eth0) == *"inet $(addr_of "$i")/"* ]] || ip -n "$ns" addr add "$(addr_of "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    # Bind-mounted over /etc/hosts in the node's mount ns (as `ip netns exec` would): every node resolves every node.
    mkdir -p "/etc/netns/$ns"; cmp -s "$HOSTS" "/etc/netns/$ns/hosts" || cp "$HOSTS" "/etc/netns/$ns/hosts"
done
rm -f "$HOSTS"
step "network: $BRIDGE $CTL_ADDR/24, nodes $(for ((i = 1; i <= NODES; i++)); do printf '%s=%s ' "$(node_of "$i")" "$(addr_of "$i")"; done)"

# ---------------------------------------------------------------- config (rewritten only when changed)
mkdir -p "$ETC" "$RUN" "$LOG" "$STATE/ctld" "$STATE/spool"
changed=0
write_if_changed() {
    local path=$1 mode=$2 tmp; tmp=$(mktemp)
    cat >"$tmp"
    if [[ -f "$path" ]] && cmp -s "$tmp" "$path"; then rm -f "$tmp"; else
        install -m "$mode" "$tmp" "$path"; rm -f "$tmp"; changed=1; step "wrote $path"
    fi
}
MEM=$(( $(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) / (2 * NODES) ))
NODE_LINES="" GRES_LINES=""
for ((i = 1; i <= NODES; i++)); do
    n=$(node_of "$i"); dir=$STATE/fakegpu/$n; mkdir -p "$dir"
    for ((g = 0; g < GPUS; g++)); do
        [[ -c "$dir/fakegpu$g" ]] || { rm -f "$dir/fakegpu$g"; mknod "$dir/fakegpu$g" c 195 "$g"; }
    done
    NODE_LINES+="NodeName=$n NodeHostname=$n NodeAddr=$(addr_of "$i") CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM Gres=gpu:$GPUS State=UNKNOWN"$'\n'
    GRES_LINES+="NodeName=$n Name=gpu File=$dir/fakegpu[0-$((GPUS - 1))]"$'\n'
done
if [[ $ACCOUNTING == 1 ]]; then
    sacctmgr -n list cluster >/dev/null 2>&1 || die "slurmdbd does not answer: run scripts/slurm_test_cluster.sh first"
    if [[ -z $(sacctmgr -n -P list cluster "$CLUSTER" format=cluster) ]]; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null; step "registered cluster $CLUSTER in the shared slurmdbd"
    fi
fi
# Job ids must not repeat in accounting (--stop wipes the controller's state, and sacct/submitit would read an
# old job's state for a reused id): a fresh config starts after the highest id accounting has for this cluster.
FIRST_JOB_ID=1
if [[ -f $CONF ]]; then
    FIRST_JOB_ID=$(sed -n 's/^FirstJobId=//p' "$CONF"); FIRST_JOB_ID=${FIRST_JOB_ID:-1}
elif [[ $ACCOUNTING == 1 ]]; then
    last=$(sacct -M "$CLUSTER" -a -X -D -n -P -o jobid -S 1970-01-01 -E now 2>/dev/null | sed 's/[^0-9].*//' | sort -n | tail -1)
    FIRST_JOB_ID=$(( ${last:-0} + 1 ))
fi
if [[ $ACCOUNTING == 1 ]]; then
    ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
    ACCT="AccountingStorageType=accounting_storage/none"
fi

write_if_changed "$CONF" 644 <<EOF
# Written by scripts/slurm_multinode_cluster.sh: $NODES nodes in network namespaces, $GPUS fake GPUs each.
ClusterName=$CLUSTER
SlurmctldHost=$(hostname -s)($CTL_ADDR)
SlurmctldPort=$CTL_PORT
SlurmdPort=$SLURMD_PORT
FirstJobId=$FIRST_JOB_ID
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=1000
GresTypes=gpu
ReturnToService=2
JobRequeue=1
AuthInfo=cred_expire=5
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1,default_queue_depth=1000
MinJobAge=60
KillWait=5
MessageTimeout=10
InactiveLimit=0
MailProg=/bin/true
SlurmdTimeout=60
$ACCT
# Preemption as a site configures it (tests/test_slurm_preempt.py): a job of partition $URGENT (PriorityTier=2)
# preempts jobs of $PARTITION, which Slurm requeues (SIGTERM now, SIGKILL after GraceTime)
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
${NODE_LINES}PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=$URGENT Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
write_if_changed "$ETC/gres.conf" 644 <<<"${GRES_LINES%$'\n'}"

if ((changed)); then  # daemons of this cluster hold a stale config: restart them
    for ((i = 1; i <= NODES; i++)); do
        f=$RUN/slurmd-$(node_of "$i").pid; if pid_alive "$f"; then stop_pid "slurmd $(node_of "$i")" "$(cat "$f")"; fi
    done
    if pid_alive "$RUN/slurmctld.pid"; then stop_pid slurmctld "$(cat "$RUN/slurmctld.pid")"; fi
fi

# ---------------------------------------------------------------- daemons
if ! pid_alive "$RUN/slurmctld.pid"; then
    slurmctld -f "$CONF"
    wait_for 30 mn scontrol ping || die "slurmctld did not answer (see $LOG/slurmctld.log)"
    step "started slurmctld on $CTL_ADDR:$CTL_PORT"
fi
for ((i = 1; i <= NODES; i++)); do
    n=$(node_of "$i")
    if ! pid_alive "$RUN/slurmd-$n.pid"; then
        mkdir -p "$STATE/spool/$n"
        # Own netns, own UTS ns (hostname) and own mount ns (only for /etc/hosts). Not `ip netns exec`: it
        # remounts /sys, which drops the /sys/fs/cgroup mounts that slurmd's cgroup plugin init requires.
        nsenter --net="/run/netns/$(netns_of "$i")" unshare --mount --uts --propagation private sh -c \
            "mount --bind /etc/netns/$(netns_of "$i")/hosts /etc/hosts && hostname $n && exec slurmd -f $CONF -N $n"
        step "started slurmd $n in netns $(netns_of "$i")"
    fi
done

nodes_ready() { [[ $(mn sinfo -h -p "$PARTITION" -o '%t %D' | awk '$1 ~ /^(idle|mix|alloc)$/ {n += $2} END {print n+0}') == "$NODES" ]]; }
if ! wait_for 30 nodes_ready; then
    mn scontrol update nodename="$(node_of 1)-$NODES" state=resume 2>/dev/null || true
    for ((i = 1; i <= NODES; i++)); do mn scontrol update nodename="$(node_of "$i")" state=resume 2>/dev/null || true; done
    wait_for 15 nodes_ready || die "nodes not ready: $(mn sinfo -h -N -p "$PARTITION" -o '%N=%t' | tr '\n' ' ') (see $LOG/slurmd-*.log)"
fi
step "$NODES nodes up: $(mn sinfo -h -N -p "$PARTITION" -o '%N=%t' | tr '\n' ' ')(export SLURM_CONF=$CONF)"

[[ $MODE == check ]] || exit 0

# ---------------------------------------------------------------- smoke test
mn sinfo
out=$(mn srun -N"$NODES" --ntasks-per-node=1 --gres=gpu:1 -t 1 \
    bash -c 'echo "$(hostname) $SLURM_PROCID CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"' | sort)
echo "$out"
[[ $(awk '{print $1}' <<<"$out" | sort -u | wc -l) == "$NODES" ]] || die "srun -N$NODES did not run on $NODES hostnames"
step "srun -N$NODES ok: $NODES distinct hostnames"

# torch.distributed (gloo) across the nodes' namespaces: MASTER_ADDR is the job's first node, as a launcher sets it.
python3 -c 'import torch.distributed' 2>/dev/null || { step "torch not importable: skipped the gloo all_reduce check"; exit 0; }
out=$(mn srun -N"$NODES" --ntasks-per-node=1 -t 2 bash -c '
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1) MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
    exec python3 -c "
import datetime, os, socket, torch, torch.distributed as dist
r, w = int(os.environ[\"SLURM_PROCID\"]), int(os.environ[\"SLURM_NTASKS\"])
dist.init_process_group(\"gloo\", rank=r, world_size=w, timeout=datetime.timedelta(seconds=60))
x = torch.tensor([r + 1.0]); dist.all_reduce(x)
print(socket.gethostname(), r, int(x.item()))
"' 2>/dev/null | sort)
echo "$out"
[[ $(awk '{print $3}' <<<"$out" | sort -u) == "$((NODES * (NODES + 1) / 2))" && $(wc -l <<<"$out") == "$NODES" ]] \
    || die "gloo all_reduce across $NODES nodes failed: $out"
step "gloo all_reduce across $NODES nodes ok"
