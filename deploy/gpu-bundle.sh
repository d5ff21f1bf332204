#!/bin/bash
# Collects what deploy/gpu-check.sh needs on a GPU machine into one folder: the daemon, the CUDA
# device tests, the CUDA benchmark, the client library with the Python package and its CUDA
# tests, and every shared library they load that is not part of the base system (glibc,
# libstdc++, libgcc_s) or of the GPU driver (libcuda). The GPU machines have the driver, PyTorch
# and transformers but none of Debian's packages, so gRPC, Abseil, Protobuf, OpenSSL, liburing,
# hiredis, yaml-cpp, prometheus-cpp and Google Benchmark travel beside the binaries. The CUDA
# runtime is linked statically (gpu/CMakeLists.txt). About 35 MiB.
#
#   deploy/gpu-bundle.sh [build dir, default build] [out dir, default gpu-bundle]
#
# Then copy the out dir to the GPU machine and run the checks there (README, "GPU check"):
#   gpu-bundle/gpu-check.sh
# The binaries need a glibc at least as new as this machine's (Debian 12: 2.36).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
out=${2:-$root/gpu-bundle}
bins=(kvcellar_bench_cuda kvcellard kvcellar_gpu_tests)
client_lib=libkvcellar-client.so

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in "${bins[@]}"; do
  if [[ ! -x "$build/bin/$b" ]]; then
    echo "gpu-bundle: $build/bin/$b is missing: build it first (cmake --build $build)" >&2
    exit 1
  fi
  cp "$build/bin/$b" "$out/bin/"
done
if [[ ! -e "$build/lib/$client_lib" ]]; then
  echo "gpu-bundle: $build/lib/$client_lib is missing: build it first (cmake --build $build)" >&2
  exit 1
fi
# A plain file under the name the Python package is told to load (KVCELLAR_CLIENT_LIBRARY):
# symbolic links do not survive every way of copying a folder to another machine.
cp -L "$build/lib/$client_lib" "$out/lib/$client_lib"

# Base system and driver libraries stay: the GPU machine's own are the ones that must be used.
skip='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcuda)\.'
for f in "${bins[@]/#/$out/bin/}" "$out/lib/$client_lib"; do
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ "$name" =~ $skip ]]; then continue; fi
  cp -L "$path" "$out/lib/$name"
done

# The Python package and its CUDA tests, at the same paths as in the repository (the tests'
# conftest finds the daemon harness three folders up), and the check itself.
mkdir -p "$out/src/client/python/tests" "$out/src/tests/integration"
(cd "$root/client/python" && tar --exclude=__pycache__ -cf - kvcellar) |
  tar -xf - -C "$out/src/client/python"
cp "$root/client/python/tests/conftest.py" "$root/client/python/tests/test_cuda.py" \
   "$out/src/client/python/tests/"
cp "$root/tests/integration/kvcellard_process.py" "$out/src/tests/integration/"
cp "$root/deploy/gpu-check.sh" "$out/"
echo "gpu-bundle: $(ls "$out/bin" | wc -l) binaries, $(ls "$out/lib" | wc -l) libraries," \
     "$(du -sm "$out" | cut -f1) MiB in $out"
