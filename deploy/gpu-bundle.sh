#!/bin/bash
# Collects what a run on a GPU machine needs into one folder: the CUDA benchmark, the daemon, the
# CUDA device tests, and every shared library they load that is not part of the base system
# (glibc, libstdc++, libgcc_s) or of the GPU driver (libcuda). The GPU machines have the driver
# but none of Debian's packages, so gRPC, Abseil, Protobuf, OpenSSL, liburing, hiredis, yaml-cpp,
# prometheus-cpp and Google Benchmark travel beside the binaries. The CUDA runtime is linked
# statically (gpu/CMakeLists.txt).
#
#   deploy/gpu-bundle.sh [build dir, default build] [out dir, default gpu-bundle]
#
# Then, with the device tool: carry the out dir (ignored by .gitignore) and run, e.g.
#   LD_LIBRARY_PATH=$PWD/gpu-bundle/lib gpu-bundle/bin/kvcellar_bench_cuda
#   LD_LIBRARY_PATH=$PWD/gpu-bundle/lib gpu-bundle/bin/kvcellar_gpu_tests --gtest_filter='Cuda*'
# kvcellar_bench_cuda finds kvcellard beside itself. The binaries need a glibc at least as new as
# this machine's (Debian 12: 2.36).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
out=${2:-$root/gpu-bundle}
bins=(kvcellar_bench_cuda kvcellard kvcellar_gpu_tests)

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in "${bins[@]}"; do
  if [[ ! -x "$build/bin/$b" ]]; then
    echo "gpu-bundle: $build/bin/$b is missing: build it first (cmake --build $build)" >&2
    exit 1
  fi
  cp "$build/bin/$b" "$out/bin/"
done

# Base system and driver libraries stay: the GPU machine's own are the ones that must be used.
skip='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcuda)\.'
for b in "${bins[@]}"; do
  ldd "$out/bin/$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ "$name" =~ $skip ]]; then continue; fi
  cp -L "$path" "$out/lib/$name"
done
echo "gpu-bundle: $(ls "$out/bin" | wc -l) binaries, $(ls "$out/lib" | wc -l) libraries," \
     "$(du -sm "$out" | cut -f1) MiB in $out"
