#!/usr/bin/env bash
# Create .venv and install LOPD into it. Idempotent: a second run only checks.
#   bash scripts/setup.sh          # the pipeline
#   bash scripts/setup.sh --dev    # plus the test tools
# Torch: a CPU-only machine gets the CPU build (no multi-gigabyte CUDA wheels). If the environment already has
# a torch (a GPU user's CUDA build, e.g. LOPD_PYTHON=/path/to/python), it is kept: the package asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
py=${LOPD_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" install "torch>=2.4"
  else
    # CPU build: the pinned release is served from local disk where the machine has it; elsewhere the
    # PyTorch CPU index keeps CUDA wheels out (set LOPD_TORCH_INDEX to override).
    "${pip[@]}" install "torch==2.13.0" 2>/dev/null \
      || "${pip[@]}" install torch --index-url "${LOPD_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
fi
"${pip[@]}" install -e ".${extra}"
if [ -n "$extra" ]; then
  # The example environment plugin (entry point group lopd.envs): its tests and the plugin cycle test use it.
  "${pip[@]}" install -e examples/lopd-example-env
  # BFCL data, simulated multi-turn APIs and reference checker for the benchmark tests. --no-deps: its declared
  # pins (numpy==1.26.4, every vendor SDK) would break this environment; what its APIs import is already here.
  "${pip[@]}" install --no-deps "bfcl-eval==2026.3.23" \
    || echo "warning: bfcl-eval could not be installed; the BFCL tests will be skipped" >&2
fi
echo "lopd installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
