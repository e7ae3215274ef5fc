#!/usr/bin/env bash
# The test suite, from a fresh machine: installs the environment (idempotent), then runs pytest.
# Extra arguments go to pytest (e.g. env/test.sh -k store).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/env/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
