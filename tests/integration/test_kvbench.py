"""kvcellar-bench (client/tools/bench/) against a real kvcellard: the multi-turn workload runs to
the end, every loaded byte checks out, and the hit rate is the workload's best case when L2 holds
the whole history and lower (but not zero) when it does not.

The explicit model shape gives 2 MiB page objects (8 layers x 8 KV heads x 128 x bf16 x 64
tokens), so the small workload (4 clients x R rounds x 256 new tokens: 4 x 4R distinct pages,
32R MiB) fits a 256 MiB pool and, at 4 rounds, overflows the smallest one (64 MiB) by more than
the last round's pages (which nothing reads).
"""
import json
import os
import subprocess

from conftest import BIN_DIR

BENCH = os.path.join(BIN_DIR, "kvcellar-bench")



def small(rounds=3):
    return ["--clients", "4", "--rounds", str(rounds), "--new-tokens", "256", "--output-tokens",
            "1", "--page-size", "64", "--layers", "8", "--kv-heads", "8", "--head-dim", "128",
            "--dtype", "bf16", "--no-progress"]


def run_bench(sock, *args, timeout=60):
    return subprocess.run([BENCH, "--socket", sock, *args], capture_output=True, text=True,
                          timeout=timeout)


def bench_json(daemon, tmp_path, *args, rounds=3):
    out = tmp_path / "bench.json"
    p = run_bench(daemon.socket, *small(rounds), *args, "--json", str(out))
    assert p.returncode == 0, f"rc {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    assert "hit rate" in p.stdout  # The table goes to stdout when the JSON goes to a file.
    return json.loads(out.read_text())


def test_fits_in_l2_hits_the_best_case(daemon_factory, tmp_path):
    d = daemon_factory(args=("--set", "device.kind=sim", "--set", "pool.capacity=256MiB"))
    r = bench_json(d, tmp_path)
    assert r["requests_done"] == 12
    assert r["verification"]["mismatched_bytes"] == 0
    assert r["verification"]["verified_bytes"] > 0
    hit = r["hit_rate"]
    # Rounds 1 and 2 find rounds 0 and 1's full pages: (4 + 8) pages of 64 tokens per client
    # over prompts of 256 + 513 + 770 tokens.
    assert hit["best_case_hit_tokens"] == 4 * (4 + 8) * 64
    assert hit["prompt_tokens"] == 4 * (256 + 513 + 770)
    assert hit["loaded_tokens"] == hit["best_case_hit_tokens"]
    assert hit["measured"] == hit["best_case"] > 0
    assert hit["matched_by_tier"]["L2"] == hit["best_case"]
    assert r["model"]["page_object_bytes"] == 2 * 1024 * 1024
    assert r["footprint"]["l2_bytes"] == 48 * 2 * 1024 * 1024
    assert r["backup_status"] == {"OK": 48}
    assert r["throughput"]["load_bytes"] == hit["loaded_tokens"] // 64 * 2 * 1024 * 1024
    for rpc in ("Match", "Load", "Backup", "WaitOps", "Release"):
        lat = r["latency"][rpc]
        assert lat["count"] > 0 and 0 < lat["p50_us"] <= lat["p99_us"] <= lat["max_us"], rpc


def test_small_l2_hits_less_but_not_nothing(daemon_factory, tmp_path):
    d = daemon_factory(args=("--set", "device.kind=sim", "--set", "pool.capacity=64MiB"))
    r = bench_json(d, tmp_path, rounds=4)
    assert r["requests_done"] == 16
    assert r["verification"]["mismatched_bytes"] == 0
    assert r["footprint"]["l2_fraction"] == 2
    hit = r["hit_rate"]
    assert 0 < hit["measured"] < hit["best_case"]


def test_scaled_defaults_with_tp_and_mla(daemon_factory):
    """No model flags: the shape is scaled to the daemon's L2 so the history fits (--fill 0.8)
    and the hit rate is the best case; TP 2 (two shards per page) and MLA (one shared shard)."""
    d = daemon_factory(args=("--set", "device.kind=sim", "--set", "pool.capacity=64MiB"))
    base = ["--clients", "4", "--rounds", "3", "--new-tokens", "256", "--no-progress", "--json"]
    for extra in (["--tp", "2"], ["--tp", "2", "--mla-latent", "576"]):
        p = run_bench(d.socket, *base, *extra)
        assert p.returncode == 0, f"{extra}: rc {p.returncode}\n{p.stdout}\n{p.stderr}"
        r = json.loads(p.stdout)
        assert r["model"]["auto_scaled"] is True
        assert r["footprint"]["l2_fraction"] <= 0.8
        assert r["verification"]["mismatched_bytes"] == 0
        assert r["hit_rate"]["measured"] == r["hit_rate"]["best_case"] > 0, extra


def test_rerun_with_the_same_revision_verifies_the_earlier_pages(daemon_factory, tmp_path):
    """A second run in the same namespace starts warm: round 0 hits what the first run stored,
    and those bytes, written by another process, verify."""
    d = daemon_factory(args=("--set", "device.kind=sim", "--set", "pool.capacity=256MiB"))
    first = bench_json(d, tmp_path, "--revision", "shared")
    second = bench_json(d, tmp_path, "--revision", "shared")
    assert second["verification"]["mismatched_bytes"] == 0
    assert second["hit_rate"]["measured"] > first["hit_rate"]["measured"]
    assert second["verification"]["verified_bytes"] > first["verification"]["verified_bytes"]


def test_shape_replays_the_eviction_benchmarks_trace(daemon_factory, tmp_path):
    """--shape runs a trace of core/eviction_shapes.h through the daemon: every request, every
    loaded byte verified, and beside the hit rate Belady's bound on the same trace at the pages L2
    holds (64 MiB of 1 MiB pages: 16 layers x 64 KiB). The bound lies between the measured rate
    and the unbounded cache's; the shape fixes the page size (128 tokens)."""
    d = daemon_factory(args=("--set", "device.kind=sim", "--set", "pool.capacity=64MiB"))
    out = tmp_path / "shape.json"
    p = run_bench(d.socket, "--shape", "zipf_prompts", "--shape-scale", "0.1", "--layers", "16",
                  "--no-progress", "--json", str(out))
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "shape zipf_prompts" in p.stdout and "Belady's bound at 64" in p.stdout
    r = json.loads(out.read_text())
    assert r["workload"]["shape"] == "zipf_prompts"
    assert r["requests_done"] == r["workload"]["requests"] == 600
    assert r["model"]["page_size"] == 128
    assert r["model"]["page_object_bytes"] == 1 << 20
    assert r["verification"]["mismatched_bytes"] == 0
    hit = r["hit_rate"]
    assert hit["l2_pages"] == 64
    assert 0 < hit["measured"] <= hit["bound"] < hit["best_case"]
    assert r["backup_status"].get("OK", 0) > 0


def test_bad_shape_flags_name_the_flag(tmp_path):
    """Usage errors before any daemon is reached."""
    sock = str(tmp_path / "nobody.sock")
    p = run_bench(sock, "--shape", "zipf")
    assert p.returncode == 2
    assert "--shape: unknown shape 'zipf' (want multi_turn, multi_turn_2, zipf_prompts" in p.stderr
    p = run_bench(sock, "--shape", "zipf_prompts", "--shape-scale", "2")
    assert p.returncode == 2 and "--shape-scale" in p.stderr, p.stderr


def test_shape_fixes_the_page_size(daemon):
    p = run_bench(daemon.socket, "--shape", "two_tenants", "--page-size", "64", "--no-progress")
    assert p.returncode == 2
    assert "--page-size: shape two_tenants has pages of 128 tokens" in p.stderr


def test_bad_flags_name_the_flag(daemon):
    for args, needle in ((["--clinets", "3"], "unknown flag --clinets"),
                         (["--clients", "x"], "--clients: 'x' is not"),
                         (["--parallel", "0"], "--parallel: 0 is out of range"),
                         (["--fill", "-1"], "--fill"),
                         (["--dtype", "fp6"], "--dtype: 'fp6'"),
                         (["--tp", "2", "--kv-heads", "3"], "--kv-heads"),
                         (["--gpu-blocks", "2"], "--gpu-blocks")):
        p = run_bench(daemon.socket, *args)
        assert p.returncode == 2, (args, p.stderr)
        assert needle in p.stderr, (args, p.stderr)


def test_unreachable_daemon_is_a_setup_error(tmp_path):
    p = run_bench(str(tmp_path / "nobody.sock"), "--no-progress")
    assert p.returncode == 3
    assert "cannot reach kvcellard" in p.stderr
