#!/usr/bin/env bash
# Installs every build and test dependency of kvcellar from Debian 12 packages.
# Idempotent and non-interactive: packages already present are skipped by apt itself, and
# `apt-get update` runs only when a wanted package is missing.
set -euo pipefail

PACKAGES=(
  # Toolchain.
  build-essential cmake ninja-build pkg-config git
  # gRPC, Protobuf and the health/reflection protos.
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  # Core libraries.
  libabsl-dev liburing-dev libssl-dev libyaml-cpp-dev libhiredis-dev
  # Metrics HTTP listener (header-only).
  libcpp-httplib-dev
  # Tests and benchmarks.
  libgtest-dev libgmock-dev libbenchmark-dev
  # Real components the tests drive.
  redis-server prometheus
  # Python side of the integration tests (for /usr/bin/python3).
  python3 python3-grpcio python3-grpc-tools python3-yaml python3-protobuf python3-pytest
  # Tools the tests call.
  openssl procps systemd fio
)

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
