#!/usr/bin/env bash
# Builds llama.cpp's reference server (llama-cpp-python 0.3.36, from source) into a scratch venv
# outside the repo; bench/vs_refs.py finds it with --llamacpp-python or SPLITSERVE_REF_LLAMACPP.
# It is never a dependency of splitserve. On 2 idle cores the build takes about 20 minutes (95 here
# while other work kept the load average at 10-15); it runs at the lowest priority on one compile
# job so that the machine stays usable meanwhile.
#
# Known problem: built this way (GGML_NATIVE) on a Xeon with AMX-BF16/AMX-INT8 and AVX512-VNNI,
# llama-cpp-python 0.3.36 segfaults in llama_decode on the demo model's first eval (one thread or
# two, logits_all or not); on AVX2-only CPUs it runs. LLAMACPP_CMAKE_ARGS replaces the CMake flags.
# On that Xeon this keeps every AVX-512 path and leaves AMX out, and runs:
#   "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
#    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
#    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# and "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" stands in
# for an AVX2-only CPU.
#
#   [LLAMACPP_CMAKE_ARGS=...] bash bench/refs/setup_llamacpp.sh [VENV]   (VENV defaults to /work/refs/llamacpp)
set -euo pipefail
VENV=${1:-/work/refs/llamacpp}
PY=${PYTHON:-python3}          # CPython 3.11 here
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip==24.3.1
# PyPI has only the sdist for 0.3.36, so pip compiles the bundled llama.cpp with CMake. GGML_NATIVE
# (the default) tunes it for this CPU (AVX2 here), as a user building it on their box would get.
CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-1} MAKEFLAGS=-j${JOBS:-1} CMAKE_ARGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON}" \
  nice -n 19 "$VENV/bin/pip" install --no-cache-dir --no-binary llama-cpp-python \
  "llama-cpp-python[server]==0.3.36"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
