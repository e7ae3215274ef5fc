#!/usr/bin/env bash
# Installs areal-hpc's CPU stack on a fresh Debian 12 machine (root): system packages + .venv.
# Idempotent: a second run with unchanged requirements only checks and exits.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${AREAL_VENV:-$ROOT/.venv}"
REQ="$ROOT/env/requirements-cpu.txt"
ENGINES="$ROOT/env/requirements-cpu-engines.txt"
VLLM="$ROOT/env/requirements-cpu-vllm.txt"

# System packages: Open MPI (mpi4py builds/links against it), a C++ compiler, bubblewrap (the code reward's sandbox).
need_apt=()
for pkg in openmpi-bin libopenmpi-dev g++ make bubblewrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "[env] apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# The installed versions, the package's own editable line left out: `pip install -c .venv/constraints.txt X`
# adds a framework (docs/agents.md) without moving torch, vLLM or anything else the tests ran with.
constraints="$VENV/constraints.txt"
write_constraints() {
  "$VENV/bin/python" -m pip freeze --exclude-editable > "$constraints.tmp"
  mv "$constraints.tmp" "$constraints"
}

# Python venv; the stamp holds a hash of the requirements + pyproject so edits trigger a reinstall.
stamp="$VENV/.areal-hpc-stamp"
want="$(cat "$REQ" "$ENGINES" "$VLLM" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  [[ -f "$constraints" ]] || write_constraints  # a venv set up before the file was written
  echo "[env] $VENV is up to date"
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and alone, so nothing later can drag in a CUDA build; then the package and its deps, with the
# test, trackers and agents extras (W&B and MLflow for logging.trackers, tests read both back; the OpenAI
# Agents SDK for the framework-written agent the tests run).
"$VENV/bin/python" -m pip install -q -r "$REQ"
"$VENV/bin/python" -m pip install -q -e "$ROOT[test,trackers,agents]"
# production training engine, CPU build: after torch, without build isolation (the sdist imports torch)
"$VENV/bin/python" -m pip install -q --no-build-isolation -r "$ENGINES"
# production generation engine, CPU build; then drop the CUDA vision/audio packages it drags in
"$VENV/bin/python" -m pip install -q -r "$VLLM"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
write_constraints
echo "$want" > "$stamp"
echo "[env] ready: source $VENV/bin/activate"
