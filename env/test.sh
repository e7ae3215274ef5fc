#!/usr/bin/env bash
# The test suite, from a fresh machine: installs the environment and starts the local Slurm cluster
# (both idempotent), then the linter and formatter check (ruff, configured in pyproject.toml), then
# pytest. Extra arguments go to pytest (e.g. env/test.sh -k store).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/env/setup.sh"
bash "$ROOT/env/slurm-up.sh"   # the Slurm end-to-end tests run against it (env/slurm-down.sh stops it)
cd "$ROOT"
"$ROOT/.venv/bin/ruff" check .
"$ROOT/.venv/bin/ruff" format --check .
exec "$ROOT/.venv/bin/python" -m pytest "$@"
