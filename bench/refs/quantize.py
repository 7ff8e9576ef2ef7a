"""Quantize a GGUF file with llama.cpp's own quantizer (``llama_model_quantize``, through
llama-cpp-python), for the types the ``gguf`` library cannot write (the K-quants). It runs under
the reference venv's python (``bench/refs/setup_llamacpp.sh``), never splitserve's:

    /work/refs/llamacpp/bin/python bench/refs/quantize.py IN.gguf OUT.gguf [Q4_K_M] [THREADS]

llama.cpp picks each tensor's type itself: Q4_K_M keeps some in Q6_K, and a tensor whose rows are
not a multiple of 256 (Qwen2.5-0.5B's 896 and 4864) falls back to another type; it logs each.
``bench/q4k.py`` lists what the output holds.
"""

import ctypes
import sys


def main(argv: list[str]) -> int:
    import llama_cpp

    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = argv[1], argv[2]
    kind = argv[3] if len(argv) > 3 else "Q4_K_M"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = int(argv[4]) if len(argv) > 4 else 0  # 0: every core
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize({src}, {dst}, {kind}) returned {rc}", file=sys.stderr)
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
