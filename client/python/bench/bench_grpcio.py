"""What a pure-Python client through PyPI's grpcio would cost per call, against the package's
native client (libkvcellar-client through ctypes), in one run against one daemon.

The engine wheel (`deploy/package.sh wheel`) could have dropped the native client and spoken gRPC
from Python instead (issue #30 left the choice to this measurement). The two sides make the same
Match of one 2048-page prompt, every page an L2 hit, on the same session, taking turns call by
call: by keys (the engine already has them: one 64 KiB bytes field) and by token ids (the daemon
derives the keys; grpcio needs the tokens as a repeated field, so they pass through Python ints,
where the native client hands the array over as it is). The table gives each side's p50 and the
median of the paired differences (grpcio's call i minus the native call i).

The native client's own cost over the C++ client is bench_calls.py's figure; the two together
say what grpcio would add over C++, which #10's goal bounds by max(20 us, 10%).

    .venv-vllm/bin/python client/python/bench/bench_grpcio.py        # needs grpcio, protobuf, numpy

The interpreter needs grpcio and protobuf (the vLLM venv has both); the stubs are generated from
proto/ with grpc_tools when it is there, else with Debian's protoc and grpc_python_plugin.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))

import bench_calls as bc  # noqa: E402
from kvcellard_process import Daemon  # noqa: E402


def stubs(workdir: Path):
    """(cache_service_pb2, cache_service_pb2_grpc, common_pb2), generated from proto/ into
    `workdir` by grpc_tools when this interpreter has it, else by the system's protoc and
    grpc_python_plugin (deploy/install-deps.sh), whose output today's protobuf runtimes read."""
    out = workdir / "stubs"
    out.mkdir()
    protos = [str(p) for p in sorted((ROOT / "proto" / "kvcellar" / "v1").glob("*.proto"))]
    args = [f"-I{ROOT / 'proto'}", f"--python_out={out}", f"--grpc_python_out={out}", *protos]
    try:
        from grpc_tools import protoc  # type: ignore

        rc = protoc.main(["protoc", *args])
    except ImportError:
        plugin = shutil.which("grpc_python_plugin")
        rc = subprocess.run(["protoc", f"--plugin=protoc-gen-grpc_python={plugin}", *args]).returncode
    if rc != 0:
        raise RuntimeError(f"protoc: exit {rc}")
    # The stubs' package is kvcellar.v1, inside the name of the client package imported above:
    # that package's path gains their folder.
    import kvcellar

    kvcellar.__path__.append(str(out / "kvcellar"))
    return (importlib.import_module("kvcellar.v1.cache_service_pb2"),
            importlib.import_module("kvcellar.v1.cache_service_pb2_grpc"),
            importlib.import_module("kvcellar.v1.common_pb2"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()

    import grpc

    with tempfile.TemporaryDirectory(prefix="kvc-grpcio-") as tmp:
        work = Path(tmp)
        pb, pb_grpc, common = stubs(work)
        daemon = Daemon(work, args=["--set", "pool.capacity=1GiB"]).start()
        try:
            py = bc.PyCalls(daemon.socket, bc.Shape(args.pages, 1, 256, args.page_size), seed=7)
            s, pages = py.session, args.pages
            sid = s.info().session_id
            channel = grpc.insecure_channel(f"unix://{daemon.socket}")
            stub = pb_grpc.CacheServiceStub(channel)
            none = common.PREFETCH_POLICY_NONE
            keys = np.ascontiguousarray(py.keys).tobytes()
            tokens = py.tokens

            def grpc_keys():
                return stub.Match(pb.MatchRequest(
                    session_id=sid, prefetch_policy=none,
                    sequences=[pb.MatchSequence(page_keys=keys)]), timeout=5)

            def grpc_tokens():
                return stub.Match(pb.MatchRequest(
                    session_id=sid, prefetch_policy=none,
                    sequences=[pb.MatchSequence(token_ids=tokens.tolist())]), timeout=5)

            def grpc_hits(reply):
                return reply.results[0].l2_hit_pages

            cases = {
                "match_keys": (lambda: s.match([py.keys], by_keys=True, prefetch="none"),
                               grpc_keys),
                "match_tokens": (lambda: s.match([tokens], prefetch="none"), grpc_tokens),
            }
            rows = []
            clock = time.perf_counter_ns
            for name, (native, remote) in cases.items():
                nat, rem = [], []
                for i in range(args.warmup + args.iterations):
                    t0 = clock()
                    a = native()
                    t1 = clock()
                    b = remote()
                    t2 = clock()
                    if a.results[0].l2_hit_pages != pages or grpc_hits(b) != pages:
                        raise RuntimeError(f"{name}: hits {a.results[0].l2_hit_pages}, "
                                           f"{grpc_hits(b)} of {pages}")
                    if i >= args.warmup:
                        nat.append((t1 - t0) / 1e3)
                        rem.append((t2 - t1) / 1e3)
                rows.append((name, statistics.median(nat), statistics.median(rem),
                             statistics.median(r - n for n, r in zip(nat, rem))))
            channel.close()
            py.close()
        finally:
            daemon.stop()
    print(f"grpcio {grpc.__version__}, {args.pages} pages of {args.page_size} tokens, "
          f"{args.iterations} calls each, alternating")
    print("| call | native p50 us | grpcio p50 us | grpcio - native (median of pairs) us |")
    print("|---|---|---|---|")
    for name, n, r, d in rows:
        print(f"| {name} | {n:.1f} | {r:.1f} | {d:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
