#!/usr/bin/env bash
# Stops the local cluster env/slurm-up.sh started: exactly the daemons whose pid files it wrote under
# $AREAL_SLURM_DIR (a munged that was already running before is left alone). State is kept, so a
# later env/slurm-up.sh brings back the same cluster, accounting history included.
set -uo pipefail
STATE="${AREAL_SLURM_DIR:-/var/tmp/areal-slurm}"
# stop PIDFILE NAME: only if the pid still is that daemon (pids are reused after a restart)
stop() {
  local f="$1" name="$2" pid
  [[ -f "$f" ]] || return 0
  pid="$(cat "$f")"
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]]; then
    kill "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    echo "[slurm] stopped $(basename "$f" .pid) ($pid)"
  fi
  rm -f "$f"
}
stop "$STATE/run/nudge.pid" bash
for f in "$STATE"/run/slurmd-*.pid; do stop "$f" slurmd; done
stop "$STATE/run/slurmctld.pid" slurmctld
stop "$STATE/run/slurmdbd.pid" slurmdbd
stop "$STATE/run/mariadb.pid" mariadbd
stop "$STATE/munge/munged.pid" munged
exit 0
