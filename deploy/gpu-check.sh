#!/bin/bash
# Every CUDA check of kvcellar in one go, on a machine with a GPU, its driver, PyTorch and
# transformers (no build tools, no Debian packages), beside a bundle made beforehand on a build
# machine by deploy/gpu-bundle.sh:
#
#   1. the CUDA device tests (kvcellar_gpu_tests: IPC gather/scatter round trips through an engine
#      process, copy engine and copy kernel, bad requests);
#   2. the Python package's CUDA path (client/python/tests/test_cuda.py: registration from torch
#      CUDA tensors by IPC handle, interprocess ready and per-layer load events, a second engine
#      process), bytes compared bit for bit;
#   3. the reference engine (python -m kvcellar.reference) at its default, a Llama-8B-shaped
#      random model, 32 layers, bf16, a 16K-token prefix: time to first token with the cache
#      against a full prefill, and the tokens of both compared; and its MLA variant;
#   4. kvcellar_bench_cuda: Backup and Load against cudaMemcpy of the same bytes, engines at once,
#      interference with a GEMM.
#
#   deploy/gpu-check.sh [--quick] [bundle dir]      (default: the folder this script is in when it
#                                                    is a bundle's copy, else <repo>/gpu-bundle)
#
# --quick: a 4K-token, 8-layer reference and the benchmark's smoke run (under a minute).
# Environment: PYTHON (default python3), GPU_CHECK_LOGS (where the logs go, default a temp dir),
# KVCELLAR_BENCH_ARGS (more flags for kvcellar_bench_cuda). Prints one Markdown table, then the
# benchmark's tables; exits 1 if any check failed, 2 if there is no usable GPU.
set -uo pipefail

quick=0
bundle=
for a in "$@"; do
  case "$a" in
    --quick) quick=1 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    -*) echo "gpu-check: unknown flag $a" >&2; exit 64 ;;
    *) bundle=$a ;;
  esac
done
here=$(cd "$(dirname "$0")" && pwd)
if [[ -z "$bundle" ]]; then
  if [[ -x "$here/bin/kvcellard" ]]; then bundle=$here; else bundle=$here/../gpu-bundle; fi
fi
if [[ ! -x "$bundle/bin/kvcellard" || ! -d "$bundle/src/client/python/kvcellar" ]]; then
  echo "gpu-check: $bundle is not a bundle: make one with deploy/gpu-bundle.sh" >&2
  exit 64
fi
bundle=$(cd "$bundle" && pwd)
py=${PYTHON:-python3}
logs=${GPU_CHECK_LOGS:-$(mktemp -d -t kvcellar-gpu-check.XXXXXX)}
mkdir -p "$logs"
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCELLAR_BIN_DIR=$bundle/bin
export KVCELLAR_CLIENT_LIBRARY=$bundle/lib/libkvcellar-client.so
export PYTHONPATH=$bundle/src/client/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

rows=()
failed=0
row() {  # check, result, figures
  rows+=("| $1 | $2 | $3 |")
  echo "gpu-check: | $1 | $2 | $3 |" >&2  # as it goes, in case the run is cut short
  [[ "$2" == pass ]] || failed=1
}
run() {  # log name, time limit (s), command...: the command's exit status; output in the log
  local name=$1 limit=$2
  shift 2
  echo "gpu-check: $name ..." >&2
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
}
verdict() {  # exit status -> pass / timed out / failed (exit N)
  case "$1" in
    0) echo pass ;;
    124|137) echo "timed out" ;;
    *) echo "failed (exit $1)" ;;
  esac
}

# 0. The machine.
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
      head -1)
torch_info=$("$py" -c 'import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"cuda {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
assert torch.cuda.is_available(), "torch sees no CUDA device"' 2>&1)
rc=$?
row "GPU and PyTorch" "$( ((rc == 0)) && echo pass || echo "failed")" \
    "$gpu; $(tail -1 <<<"$torch_info")"
if ((rc != 0)); then
  printf '%s\n' "| check | result | figures |" "|---|---|---|" "${rows[@]}"
  echo "gpu-check: no usable GPU; logs in $logs" >&2
  exit 2
fi

# 1. CUDA device tests. CudaIpcEngineChild.Run is the engine process the IPC test starts.
run gpu_tests 300 "$bundle/bin/kvcellar_gpu_tests" --gtest_filter='-CudaIpcEngineChild.*'
rc=$?
# The last summary line is this process's (the engine child prints its own before it).
passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$logs/gpu_tests.log" | tail -1)
skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$logs/gpu_tests.log" | tail -1)
cuda_skips=$(grep '^\[  SKIPPED \] Cuda' "$logs/gpu_tests.log" | sort -u | wc -l)
result=$(verdict $rc)
# On a GPU machine a CUDA test that skips is a failure: it did not run what it is for.
if [[ $result == pass && $cuda_skips -gt 0 ]]; then result="failed ($cuda_skips CUDA tests skipped)"; fi
row "CUDA device tests (kvcellar_gpu_tests)" "$result" \
    "${passed:-0} passed, ${skipped:-0} skipped; $(grep -c '^\[       OK \] Cuda' "$logs/gpu_tests.log") CUDA tests ran"

# 2. The Python package's CUDA path.
run python_cuda 300 "$py" -m pytest -q -rs -p no:cacheprovider \
    "$bundle/src/client/python/tests/test_cuda.py"
rc=$?
summary=$(grep -E '^[0-9]+ (passed|failed|skipped)|^=+ .*(passed|failed|error)' \
          "$logs/python_cuda.log" | tail -1 | tr -d '=')
result=$(verdict $rc)
if [[ $result == pass && "$summary" == *skipped* ]]; then result="failed (skipped)"; fi
row "Python CUDA path (test_cuda.py)" "$result" "${summary# }"

# 3. The reference engine: TTFT with the cache against a full prefill.
reference() {  # name, label, flags...
  local name=$1 label=$2
  shift 2
  run "$name" 600 "$py" -m kvcellar.reference --kvcellard "$bundle/bin/kvcellard" "$@"
  local rc=$?
  local json
  json=$(grep '^{' "$logs/$name.log" | tail -1)
  if ((rc != 0)) || [[ -z "$json" ]]; then
    row "$label" "$(verdict $rc)" "$(tail -1 "$logs/$name.log" | cut -c1-160)"
    return
  fi
  local line
  line=$("$py" - "$json" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
pages = r["prefix_tokens"] // 16
ok = r["tokens_agree"] and not r["miss_reasons"] and all(h >= pages for h in r["hit_pages"])
print("pass" if ok else "failed", end="|")
print(f"{r['prefix_tokens']}+{r['suffix_tokens']} tokens, {r['layers']} layers {r['dtype']}: "
      f"TTFT {r['ttft_cached_s'] * 1e3:.1f} ms cached vs {r['ttft_full_prefill_s'] * 1e3:.1f} ms "
      f"prefill ({r['speedup']:.1f}x); hits {r['hit_pages']} of {pages} pages; tokens "
      f"{'agree' if r['tokens_agree'] else 'DIFFER'}"
      + (f"; misses {r['miss_reasons']}" if r["miss_reasons"] else ""))
PY
)
  row "$label" "${line%%|*}" "${line#*|}"
}
if ((quick)); then
  reference reference_gqa "Reference engine, GQA (python -m kvcellar.reference)" \
      --prefix-tokens 4096 --layers 8
  reference reference_mla "Reference engine, MLA (--mla)" --mla --prefix-tokens 4096 --layers 4
else
  reference reference_gqa "Reference engine, GQA (python -m kvcellar.reference)"
  reference reference_mla "Reference engine, MLA (--mla --layers 8)" --mla --layers 8
fi

# 4. The CUDA benchmark.
bench_args=()
((quick)) && bench_args+=(--cuda_smoke)
# shellcheck disable=SC2206  # word splitting of the extra flags is the point
bench_args+=(${KVCELLAR_BENCH_ARGS:-})
run bench_cuda 900 "$bundle/bin/kvcellar_bench_cuda" "${bench_args[@]}"
rc=$?
tables=$(grep -c '^| ' "$logs/bench_cuda.log")
result=$(verdict $rc)
if [[ $result == pass ]] && grep -q 'no CUDA device' "$logs/bench_cuda.log"; then
  result="failed (no CUDA device)"
fi
row "CUDA benchmark (kvcellar_bench_cuda ${bench_args[*]})" "$result" \
    "$tables table rows, below"

printf '%s\n' "| check | result | figures |" "|---|---|---|" "${rows[@]}"
echo
grep -E '^\||^#' "$logs/bench_cuda.log"
echo
echo "gpu-check: logs in $logs" >&2
exit $failed
