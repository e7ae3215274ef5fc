#!/usr/bin/env bash
# Stops the local cluster env/slurm-up.sh started: exactly the daemons whose pid files it wrote under
# $AREAL_SLURM_DIR (a munged that was already running before is left alone). State is kept, so a
# later env/slurm-up.sh brings back the same cluster, accounting history included.
set -uo pipefail
STATE="${AREAL_SLURM_DIR:-/var/tmp/areal-slurm}"
stop() {
  local f="$1" pid
  [[ -f "$f" ]] || return 0
  pid="$(cat "$f")"
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    echo "[slurm] stopped $(basename "$f" .pid) ($pid)"
  fi
  rm -f "$f"
}
stop "$STATE/run/nudge.pid"
for f in "$STATE"/run/slurmd-*.pid; do stop "$f"; done
stop "$STATE/run/slurmctld.pid"
stop "$STATE/run/slurmdbd.pid"
stop "$STATE/run/mariadb.pid"
stop "$STATE/munge/munged.pid"
exit 0
