#!/usr/bin/env bash
# Regenerates kernels.ptx from kernels.cu. Needs nvcc (any CUDA 12.x or 13.x toolkit).
# The PTX targets sm_75 so every GPU from Turing on JIT-compiles it, and its ISA version
# is lowered to 8.0 (CUDA 12.0) so 12.x drivers accept it too: the kernel uses only plain
# loads and stores, which PTX 8.0 has.
set -euo pipefail
cd "$(dirname "$0")"
nvcc -ptx -arch=compute_75 -O3 -o kernels.ptx kernels.cu
sed -i -E 's/^\.version [0-9]+\.[0-9]+/.version 8.0/' kernels.ptx
echo "wrote $(pwd)/kernels.ptx"
