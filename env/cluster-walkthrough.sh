#!/usr/bin/env bash
# docs/cluster.md's commands on the local Slurm cluster, the CPU demo config standing in for a GPU recipe: the
# prerequisite checks that need no GPU, then the run's life (render, sbatch, status while pending and while
# running, cancel, resume with more versions, export, eval), the split sized from that run (simulate
# --calibrate) and TensorBoard's view of it. Prints each command and what it said; stops at the first failure.
#   bash env/cluster-walkthrough.sh [WORK_DIR]      (default: a new folder under /tmp; ~3 minutes)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/areal-guide.XXXX)}"
AREAL="$ROOT/.venv/bin/areal-hpc"
bash "$ROOT/env/slurm-up.sh" >/dev/null
mkdir -p "$WORK/jobs" && cp "$ROOT/jobs/demo.yaml" "$WORK/jobs/" && cd "$WORK"
say() { printf "\n$ %s\n" "$*" >&2; "$@"; }
wait_for() {  # wait_for RUN_DIR TEXT: until status prints TEXT (3 minutes at most)
  # status read whole first: grep -q on the pipe would leave before status's last line, failing it (pipefail)
  for _ in $(seq 360); do grep -q "$2" <<<"$("$AREAL" status "$1" 2>/dev/null)" && return 0; sleep 0.5; done
  echo "status never said '$2'"; "$AREAL" status "$1"; return 1
}

# -- what the cluster must have (the GPU checks, nvidia-smi and flash_attn, need a GPU node)
PY="$ROOT/.venv/bin/python"
say sinfo --version
say srun --mpi=list
say "$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
say "$PY" --version
say findmnt -n -o FSTYPE -T "$WORK"
"$ROOT/.venv/bin/ds_report" >/dev/null 2>&1 && echo "(ds_report ran)"

# -- the run's life
say "$AREAL" render jobs/demo.yaml run_name=guide trainer.versions=100000 > guide.sbatch
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
say "$AREAL" status runs/guide
# +40: 40 versions more than where the cancel stopped it (status's version), the export's number below
stopped=$("$AREAL" status runs/guide | sed -n 's|.*version \([0-9][0-9]*\)/.*|\1|p' | head -1)
say "$AREAL" resume runs/guide trainer.versions=+40
wait_for runs/guide "COMPLETED"
say "$AREAL" status runs/guide
say "$AREAL" export "runs/guide/checkpoints/v$(printf %08d $((stopped + 40)))" runs/guide-hf
say "$AREAL" eval runs/guide-hf --config runs/guide/config.yaml
# -- the split, sized from this run; TensorBoard reads the same folder (--inspect: a summary, no server)
say "$AREAL" simulate --calibrate runs/guide --sweep cluster.n_generators=1,2,3
say "$ROOT/.venv/bin/tensorboard" --inspect --logdir runs/guide/tensorboard 2>/dev/null \
  | grep -a -E "^scalars|^   (heldout_acc|reward_mean|staleness_max|weights_match)$"
echo; echo "walkthrough done in $WORK"
