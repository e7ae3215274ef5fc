#!/usr/bin/env bash
# docs/cluster.md's "The run's life", command by command, on the local Slurm cluster with the CPU demo config
# standing in for a GPU recipe: render, sbatch, status while pending and while running, cancel, resume with
# more versions, export, eval. Prints each command and what it said; stops at the first that fails.
#   bash env/cluster-walkthrough.sh [WORK_DIR]      (default: a new folder under /tmp; ~3 minutes)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/areal-guide.XXXX)}"
AREAL="$ROOT/.venv/bin/areal-hpc"
bash "$ROOT/env/slurm-up.sh" >/dev/null
mkdir -p "$WORK/jobs" && cp "$ROOT/jobs/demo.yaml" "$WORK/jobs/" && cd "$WORK"
say() { printf "\n$ %s\n" "$*" >&2; "$@"; }
wait_for() {  # wait_for RUN_DIR TEXT: until status prints TEXT (3 minutes at most)
  for _ in $(seq 360); do "$AREAL" status "$1" 2>/dev/null | grep -q "$2" && return 0; sleep 0.5; done
  echo "status never said '$2'"; "$AREAL" status "$1"; return 1
}

say "$AREAL" render jobs/demo.yaml run_name=guide trainer.versions=100000 logging.tensorboard=false > guide.sbatch
echo "(guide.sbatch: $(wc -l < guide.sbatch) lines)"
# held at submission, so that an idle local cluster shows a pending job; a real queue does this by itself
job=$(sbatch --parsable --hold guide.sbatch)
echo "\$ sbatch --hold guide.sbatch   ->  job $job"
say "$AREAL" status runs/guide
scontrol release "$job"
wait_for runs/guide "progress: version [3-9]"
say "$AREAL" status runs/guide
say "$AREAL" cancel runs/guide
wait_for runs/guide "CANCELLED"
say "$AREAL" resume runs/guide trainer.versions=40
wait_for runs/guide "COMPLETED"
say "$AREAL" status runs/guide
say "$AREAL" export runs/guide/checkpoints/v00000040 runs/guide-hf
say "$AREAL" eval runs/guide-hf --config runs/guide/config.yaml
echo; echo "walkthrough done in $WORK"
