#!/usr/bin/env bash
# The CPU demo, from a fresh machine: installs the environment (idempotent), then runs the asynchronous
# demo job under mpirun (1 scheduler + 2 generators + 1 trainer).
# Extra arguments are dotted config overrides (e.g. env/demo.sh trainer.max_wall_s=60).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/env/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/areal-hpc" run jobs/demo.yaml "$@"
