#!/usr/bin/env bash
# A two-node SLURM cluster on this machine, for the tests: nodes n1 and n2 are two slurmd daemons
# on 127.0.0.1. Needs root (it installs packages, starts munge and edits /etc/hosts).
#   tests/slurm/local_cluster.sh start DIR   # install if missing, write DIR/slurm.conf, start, wait for idle nodes
#   tests/slurm/local_cluster.sh stop DIR    # stop the daemons this script started, by PID
# Use the cluster with SLURM_CONF=DIR/slurm.conf.
set -euo pipefail
action=${1:?usage: $0 start|stop DIR}
dir=$(mkdir -p "${2:?usage: $0 start|stop DIR}" && cd "$2" && pwd)

stop() {
    for pidfile in "$dir"/*.pid; do
        [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
}

if [ "$action" = stop ]; then stop; exit 0; fi
[ "$action" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "SKIP: starting SLURM needs root" >&2; exit 3; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -qq slurm-wlm munge || { apt-get update -qq && apt-get install -y -qq slurm-wlm munge; }; } \
        >"$dir/apt.log" 2>&1 || { echo "SKIP: could not install slurm-wlm and munge (see $dir/apt.log)" >&2; exit 3; }
fi

# munge authenticates SLURM's messages; systemd is not running, so start it by hand
mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    su -s /bin/sh munge -c munged
fi

# the first node's name must resolve for torchrun's rendezvous
grep -qE '^127\.0\.0\.1[[:space:]].*\bn1\b' /etc/hosts || echo "127.0.0.1 n1 n2" >>/etc/hosts

stop  # leftovers of an earlier run in the same DIR
mkdir -p "$dir/state" "$dir/spool"
# free ports, so that a cluster left over elsewhere (or a real one) does not collide with this one
read -r ctld_port n1_port n2_port < <(python3 -c '
import socket
sockets = [socket.socket() for _ in range(3)]
for s in sockets: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in sockets])')
cat >"$dir/slurm.conf" <<CONF
ClusterName=localtest
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n1_port CPUs=2
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n2_port CPUs=2
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=30 State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld -i -f "$SLURM_CONF"
slurmd -N n1 -f "$SLURM_CONF"
slurmd -N n2 -f "$SLURM_CONF"
for _ in $(seq 60); do
    if [ "$(sinfo -h -o '%T' -N 2>/dev/null | grep -c idle)" = 2 ]; then
        echo "SLURM up: SLURM_CONF=$SLURM_CONF"; exit 0
    fi
    sleep 0.5
done
echo "SKIP: SLURM daemons did not report two idle nodes within 30 s (logs in $dir)" >&2
stop
exit 3
