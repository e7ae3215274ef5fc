#!/usr/bin/env bash
# Starts a real Slurm cluster on this one machine (laptop, workstation, CI): Debian's slurm-wlm with
# N virtual nodes (heterogeneous jobs need >= 2), munge, and accounting (slurmdbd + MariaDB, so `sacct`
# works and submitit notices cancelled jobs). No systemd: every daemon is started here and its pid
# file kept under $AREAL_SLURM_DIR; env/slurm-down.sh stops exactly those. Idempotent: if the cluster
# is already up it only says so. Needs root.
#
#   AREAL_SLURM_DIR    state, logs, configs, pid files      (default /var/tmp/areal-slurm)
#   AREAL_SLURM_NODES  virtual nodes                        (default 4)
#   AREAL_SLURM_CPUS   CPUs each node declares              (default 4; may exceed the real cores)
set -euo pipefail
STATE="${AREAL_SLURM_DIR:-/var/tmp/areal-slurm}"
NODES="${AREAL_SLURM_NODES:-4}"
CPUS="${AREAL_SLURM_CPUS:-4}"
MEM_MB="${AREAL_SLURM_MEM_MB:-4000}"
DB_PORT="${AREAL_SLURM_DB_PORT:-3307}"
HOST="$(hostname -s)"
CONF="$STATE/etc/slurm.conf"
say() { echo "[slurm] $*"; }
# alive PIDFILE [NAME]: the pid in the file runs, and is that daemon (pids are reused after a restart)
alive() {
  [[ -f "$1" ]] || return 1
  local pid; pid="$(cat "$1")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
  [[ -z "${2:-}" || "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]]
}
node_list="n[1-$NODES]"

# -- packages ------------------------------------------------------------------------------------
need=()
for pkg in slurm-wlm slurmctld slurmd slurm-client slurmdbd munge mariadb-server libpmix2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  say "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # no service starts during the install: this script starts what it needs itself
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  [[ "$(trap -p EXIT)" ]] && rm -f /usr/sbin/policy-rc.d
  trap - EXIT
fi

# -- already up? ----------------------------------------------------------------------------------
all_up=1
alive "$STATE/run/mariadb.pid" mariadbd && alive "$STATE/run/slurmdbd.pid" slurmdbd \
  && alive "$STATE/run/slurmctld.pid" slurmctld && alive "$STATE/run/nudge.pid" bash || all_up=0
alive "$STATE/munge/munged.pid" munged || alive "$STATE/run/munged.pid.foreign" munged || all_up=0
for i in $(seq 1 "$NODES"); do alive "$STATE/run/slurmd-n$i.pid" slurmd || all_up=0; done
if ((all_up)) && SLURM_CONF="$CONF" sinfo -h >/dev/null 2>&1; then
  say "already up ($NODES nodes, state in $STATE)"
  exit 0
fi

mkdir -p "$STATE"/{etc,log,run,state,spool,db}
for i in $(seq 1 "$NODES"); do mkdir -p "$STATE/tmp/n$i" "$STATE/spool/n$i"; done
chmod 1777 "$STATE/tmp" "$STATE"/tmp/n*

# -- munge ----------------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
  mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
mkdir -p "$STATE/munge" && chown munge:munge "$STATE/munge" && chmod 755 "$STATE/munge"
if ! alive "$STATE/munge/munged.pid" munged && ! alive "$STATE/run/munged.pid.foreign" munged; then
  rm -f "$STATE/run/munged.pid.foreign"
  if pgrep -x munged >/dev/null; then
    say "using the munged that is already running (not stopped by env/slurm-down.sh)"
    pgrep -x munged | head -1 > "$STATE/run/munged.pid.foreign"
  else
    runuser -u munge -- /usr/sbin/munged --pid-file="$STATE/munge/munged.pid"
  fi
fi
munge -n | unmunge >/dev/null || { say "munge does not work (see /var/log/munge/munged.log)"; exit 1; }

# -- MariaDB (accounting storage), on its own port and data folder --------------------------------
mkdir -p "$STATE/mysql"  # socket, pid and log of MariaDB: written by the mysql user
chown -R mysql:mysql "$STATE/db" "$STATE/mysql"
if [[ ! -d "$STATE/db/mysql" ]]; then
  mariadb-install-db --user=mysql --datadir="$STATE/db" --auth-root-authentication-method=socket >/dev/null
fi
SOCK="$STATE/mysql/mysqld.sock"
if ! alive "$STATE/run/mariadb.pid" mariadbd; then
  nohup mariadbd --user=mysql --datadir="$STATE/db" --socket="$SOCK" --pid-file="$STATE/mysql/mariadb.pid" \
    --port="$DB_PORT" --bind-address=127.0.0.1 --log-error="$STATE/mysql/mariadb.log" >/dev/null 2>&1 &
  echo $! > "$STATE/run/mariadb.pid"
  for _ in $(seq 1 300); do
    mariadb --socket="$SOCK" -e "select 1" >/dev/null 2>&1 && break
    sleep 0.1
  done
fi
mariadb --socket="$SOCK" <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'areal-slurm';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'areal-slurm';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL

# -- configs --------------------------------------------------------------------------------------
cat > "$STATE/etc/task_prolog.sh" <<EOF
#!/bin/sh
# per virtual node temp dirs: several slurmd on one host would otherwise share pmix and Open MPI files
echo "export TMPDIR=$STATE/tmp/\$SLURMD_NODENAME"
echo "export OMPI_MCA_btl_vader_backing_directory=$STATE/tmp/\$SLURMD_NODENAME"
EOF
chmod +x "$STATE/etc/task_prolog.sh"

cat > "$STATE/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=areal-slurm
StorageLoc=slurm_acct_db
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
EOF
chmod 600 "$STATE/etc/slurmdbd.conf"

last_port=$((17000 + NODES))
cat > "$CONF" <<EOF
# Written by env/slurm-up.sh: a local cluster of $NODES virtual nodes on $HOST.
ClusterName=areal
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=6817
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
# no cgroups or systemd needed
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# backfill starts heterogeneous jobs; a short interval makes them start in about a second
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate,bf_continue,batch_sched_delay=0
MpiDefault=none
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=600
MailProg=/bin/true
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
TmpFS=$STATE/tmp/%n
TaskProlog=$STATE/etc/task_prolog.sh
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$node_list NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[17001-$last_port] CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

# Commands find the config at /etc/slurm unless SLURM_CONF says otherwise: link ours there unless a
# real cluster's config is already in place.
mkdir -p /etc/slurm
for f in slurm.conf slurmdbd.conf; do
  if [[ ! -e /etc/slurm/$f || -L /etc/slurm/$f ]]; then
    ln -sfn "$STATE/etc/$f" "/etc/slurm/$f"
  else
    say "/etc/slurm/$f exists and is not ours: export SLURM_CONF=$CONF to use this cluster"
  fi
done
export SLURM_CONF="$CONF"

# -- daemons --------------------------------------------------------------------------------------
if ! alive "$STATE/run/slurmdbd.pid" slurmdbd; then
  slurmdbd
  for _ in $(seq 1 100); do timeout 2 sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done
fi
sacctmgr -n list cluster format=cluster | grep -qw areal || sacctmgr -i add cluster areal >/dev/null
fresh_ctld=0
alive "$STATE/run/slurmctld.pid" slurmctld || { slurmctld; fresh_ctld=1; }
for i in $(seq 1 "$NODES"); do
  alive "$STATE/run/slurmd-n$i.pid" slurmd || slurmd -N "n$i"
done
# Slurm's backfill scheduler (the only one that starts heterogeneous jobs) runs only after something
# changed; a requeued job becomes eligible 2 minutes later with nothing changing on an idle local
# cluster, and would wait forever. This poke every 10 s stands in for a busy cluster's traffic.
if ! alive "$STATE/run/nudge.pid" bash; then
  nohup bash -c "while sleep 10; do SLURM_CONF=$CONF scontrol update partitionname=debug state=up >/dev/null 2>&1; done" \
    >/dev/null 2>&1 &
  echo $! > "$STATE/run/nudge.pid"
fi

# A controller started anew recovers the jobs in its state folder; after a reboot or a killed
# machine their processes are gone, yet they would hold nodes (state "mixed") until they time out.
if ((fresh_ctld)); then
  for _ in $(seq 1 100); do squeue -h >/dev/null 2>&1 && break; sleep 0.1; done
  left="$(squeue -h -t RUNNING,COMPLETING,PENDING,SUSPENDED -o '%A' 2>/dev/null | sort -u | tr '\n' ' ')"
  if [[ -n "${left// /}" ]]; then
    say "cancelling jobs left from before the cluster last stopped: $left"
    # shellcheck disable=SC2086
    scancel $left 2>/dev/null || true
  fi
fi

for _ in $(seq 1 300); do
  states="$(sinfo -h -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')"
  [[ "$states" == "idle " ]] && break
  if [[ "$states" == *down* || "$states" == *drain* ]]; then
    scontrol update nodename="$node_list" state=resume 2>/dev/null || true
  fi
  sleep 0.1
done
states="$(sinfo -h -o '%T' | sort -u | tr '\n' ' ')"
if [[ "$states" != "idle " ]]; then
  say "nodes did not become idle (state: $states); see $STATE/log/"
  exit 1
fi
say "up: $NODES nodes x $CPUS CPUs, partition debug, accounting on (state and logs in $STATE)"
