"""Per-tenant L2 quotas (tenants.quotas) end to end: two tenants on one daemon, team-a replaying
kvcellar-bench's multi-turn workload, team-b flooding unique prompts at many times the pool's
size. team-a's hit rate is measured alone, beside the flood without quotas, and beside it with
equal guarantees, each on a fresh daemon in this one run; with quotas it keeps at least 0.9x of
its hit rate alone, and no loaded byte is wrong. The figures are printed (pytest -s shows them).

Both tenants run kvcellar-bench (client/tools/bench/), whose engines are the sim engine of
kvcellar-engine-sim in process, on the sim device. One shape for both (2 MiB page objects: 8
layers x 8 KV heads x 128 x bf16 x 64 tokens), so their pages share one size class and compete
for the same slots. team-a's workload (4 clients x 4 rounds x 256 new tokens) backs up 64 pages,
128 MiB: it fits the 384 MiB pool alone, and half of it (its guarantee, 192 MiB) with room. team-b
sends 16-page prompts that nobody asks for again; it starts first, fills the pool, and floods on
until team-a is done.
"""
import json
import os
import signal
import subprocess
import time

import grpc

from conftest import BIN_DIR
from engine_sim import DAEMON_ARGS, metric, require_cache_service, status, wait_until

from kvcellar.v1 import admin_service_pb2, admin_service_pb2_grpc

BENCH = os.path.join(BIN_DIR, "kvcellar-bench")
KVCELLARCTL = os.path.join(BIN_DIR, "kvcellarctl")
POOL_BYTES = 384 << 20
PAGE_BYTES = 2 << 20
SHAPE = ["--page-size", "64", "--layers", "8", "--kv-heads", "8", "--head-dim", "128",
         "--dtype", "bf16", "--output-tokens", "1", "--no-progress"]
MULTI_TURN = ["--tenant", "team-a", "--clients", "4", "--rounds", "4", "--new-tokens", "256",
              "--parallel", "2", "--seed", "1"]
# Far more than the flood needs to outlast team-a (1000 x 16 pages = 32 GiB, 83x the pool; it
# sent about 10x the pool during team-a's run here); it is stopped once team-a is done.
FLOOD = ["--tenant", "team-b", "--clients", "1000", "--rounds", "1", "--new-tokens", "1024",
         "--parallel", "4", "--seed", "2"]
QUOTAS = "tenants.quotas=team-a=guarantee:0.5;team-b=guarantee:0.5"


def start_daemon(daemon_factory, name, *extra):
    d = daemon_factory(args=(*DAEMON_ARGS, "--set", f"pool.capacity={POOL_BYTES >> 20}MiB",
                             *extra), name=name, subdir=name)
    require_cache_service(d)
    return d


def tenant(daemon, name):
    for t in status(daemon).tenants:
        if t.tenant == name:
            return t
    return None


def run_multi_turn(daemon, tmp_path, label):
    out = tmp_path / f"{label}.json"
    p = subprocess.run([BENCH, "--socket", daemon.socket, *SHAPE, *MULTI_TURN, "--json",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{label}: rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    r = json.loads(out.read_text())
    assert r["requests_done"] == 16, label
    return r


def run_beside_flood(daemon, tmp_path, label):
    """team-a's run while team-b floods; returns (team-a's report, bytes team-b sent meanwhile)."""
    flood = subprocess.Popen([BENCH, "--socket", daemon.socket, *SHAPE, *FLOOD],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: status(daemon).pool.used_bytes >= 0.9 * POOL_BYTES, timeout=30,
                   what="team-b filling the pool")
        before = tenant(daemon, "team-b").lookup_pages
        r = run_multi_turn(daemon, tmp_path, label)
        flooded = (tenant(daemon, "team-b").lookup_pages - before) * PAGE_BYTES
        assert flood.poll() is None, f"the flood ended before team-a did:\n{flood.stderr.read()}"
    finally:
        flood.send_signal(signal.SIGKILL)
        flood.wait(timeout=30)
    return r, flooded


def test_equal_guarantees_keep_a_tenants_hit_rate_under_anothers_flood(daemon_factory, tmp_path):
    t0 = time.monotonic()
    alone = run_multi_turn(start_daemon(daemon_factory, "alone"), tmp_path, "alone")

    plain = start_daemon(daemon_factory, "plain")
    no_quotas, flooded_plain = run_beside_flood(plain, tmp_path, "no-quotas")

    guarded = start_daemon(daemon_factory, "guarded", "--set", QUOTAS)
    with_quotas, flooded_guarded = run_beside_flood(guarded, tmp_path, "quotas")

    rate = {k: r["hit_rate"]["measured"]
            for k, r in (("alone", alone), ("no_quotas", no_quotas), ("quotas", with_quotas))}
    wrong = {k: r["verification"]["mismatched_bytes"]
             for k, r in (("alone", alone), ("no_quotas", no_quotas), ("quotas", with_quotas))}
    print(f"\nteam-a hit rate: alone {rate['alone']:.3f}, beside team-b's flood without quotas "
          f"{rate['no_quotas']:.3f} ({flooded_plain / POOL_BYTES:.1f}x the pool flooded meanwhile), "
          f"with equal guarantees {rate['quotas']:.3f} ({flooded_guarded / POOL_BYTES:.1f}x); "
          f"best case {alone['hit_rate']['best_case']:.3f}; mismatched bytes {wrong}; "
          f"{time.monotonic() - t0:.0f} s")

    assert all(v == 0 for v in wrong.values()), wrong
    assert alone["verification"]["verified_bytes"] > 0
    assert rate["alone"] == alone["hit_rate"]["best_case"] > 0
    assert rate["quotas"] >= 0.9 * rate["alone"], rate
    assert flooded_guarded >= POOL_BYTES, "the flood did not reach the pool's size during the run"

    # The reclaim is visible per tenant: what team-b borrowed of team-a's guarantee went back
    # (taken by team-a's allocations, or by the watermark, which takes only excess over
    # guarantees: which of the two depends on timing), and team-a, never above its guarantee,
    # lost nothing to either.
    a, b = tenant(guarded, "team-a"), tenant(guarded, "team-b")
    assert a.has_quota and a.guarantee_bytes == POOL_BYTES // 2 == b.guarantee_bytes
    assert b.evicted_by_other_tenant_pages + b.evicted_watermark_pages > 0
    assert a.evicted_by_other_tenant_pages == 0 and a.evicted_watermark_pages == 0
    assert a.l2_hit_pages > 0 and a.lookup_pages >= a.l2_hit_pages
    assert metric(guarded, "kvcellar_tenant_l2_guarantee_bytes", tenant="team-a") == POOL_BYTES // 2
    assert metric(guarded, "kvcellar_tenant_l2_evicted_pages_total", tenant="team-b",
                  cause="other_tenant") == b.evicted_by_other_tenant_pages
    p = subprocess.run([KVCELLARCTL, "--addr", guarded.admin_socket, "tenants", "--json"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    listed = {t["tenant"]: t for t in json.loads(p.stdout)["tenants"]}
    assert int(listed["team-a"]["guarantee_bytes"]) == POOL_BYTES // 2
    p = subprocess.run([KVCELLARCTL, "--addr", guarded.admin_socket, "tenants"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "team-b" in p.stdout and "EVICT_OTHER" in p.stdout, p.stdout
    # On the engine socket GetStatus lists no tenants: their names are for admin callers.
    engine_side = admin_service_pb2_grpc.AdminServiceStub(
        grpc.insecure_channel(f"unix:{guarded.socket}"))
    assert not engine_side.GetStatus(admin_service_pb2.GetStatusRequest(), timeout=5).tenants
