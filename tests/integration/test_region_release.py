"""Two models with different page object sizes on one small host pool (server/l2/l2_space.h,
"Region release"): real kvcellard, real kvcellar-engine-sim processes, every byte verified.

Model A fills every region of the pool with 64 KiB objects; model B's 1 MiB objects need a
size class with no region. B must get a whole region (before region release every B page was
NO_SPACE), taken from A by evicting exactly the pages living in it, never pinned ones.
Interpreter: Debian's /usr/bin/python3 (python3-grpcio, python3-pytest).
"""
import signal

import pytest

from engine_sim import (DAEMON_ARGS, EXIT_OK, EngineProcess, metric, require_cache_service,
                        run_engine)

# 64 MiB in 8 regions of 8 MiB: 128 slots of 64 KiB, or 8 of 1 MiB, per region.
POOL_ARGS = DAEMON_ARGS + ("--set", "pool.capacity=64MiB", "--set", "pool.region_size=8MiB")
MODEL_A = dict(layers=2, block_bytes=16384, blocks=256, page_size=16, model="model-a")  # 64 KiB
MODEL_B = dict(layers=2, block_bytes=262144, blocks=8, page_size=16, model="model-b")  # 1 MiB
# A's chains: 960 pages fill all 8 regions (the last half) and stay under the 95% watermark,
# so nothing but region release evicts here.
CHAINS_A = [(101, 256), (102, 256), (103, 256), (104, 192)]


@pytest.fixture
def small_pool_daemon(daemon_factory):
    d = daemon_factory(args=POOL_ARGS)
    require_cache_service(d)
    return d


def test_second_model_gets_a_whole_region_and_pinned_pages_survive(small_pool_daemon):
    sock = small_pool_daemon.socket
    for tseed, pages in CHAINS_A:
        r = run_engine(sock, "backup", instance="a", seed=1, tokens_seed=tseed, pages=pages,
                       **MODEL_A)
        assert r.rc == EXIT_OK and r["stored"] == pages, r.describe()

    # Chain 104 (pages 0-127 in region 6, 128-191 in the half-full region 7) stays pinned.
    holder = EngineProcess(sock, "hold", instance="holder", pin=True, tokens_seed=104, pages=192,
                           **MODEL_A)
    try:
        held = holder.first_line()
        assert held["hits"] == 192, held

        b = run_engine(sock, "backup", instance="b", seed=2, tokens_seed=201, pages=4, **MODEL_B)
        assert b.rc == EXIT_OK and b["stored"] == 4, b.describe()
        # The cheapest region without a pinned page: the second half of one of A's first three
        # chains (128 leaf pages). Releasing a first half would take its chain's second half too.
        assert metric(small_pool_daemon, "kvcellar_evicted_pages_total",
                      reason="region_release") == 128
        assert metric(small_pool_daemon, "kvcellar_evicted_pages_total", reason="pool_full") == 0
        assert metric(small_pool_daemon, "kvcellar_evicted_pages_total", reason="watermark") == 0

        loaded = run_engine(sock, "load", instance="b2", verify_seed=2, tokens_seed=201, pages=4,
                            expect_hits=4, **MODEL_B)
        assert loaded.rc == EXIT_OK and loaded["loaded"] == 4, loaded.describe()
        assert loaded["mismatched_bytes"] == 0

        hits = []
        for tseed, pages in CHAINS_A:
            r = run_engine(sock, "load", instance=f"a-{tseed}", verify_seed=1, tokens_seed=tseed,
                           pages=pages, **MODEL_A)
            assert r.rc == EXIT_OK and r["mismatched_bytes"] == 0, r.describe()
            hits.append(r["hits"])
        assert hits[3] == 192, "pinned pages are never evicted"
        assert sorted(hits[:3]) == [128, 256, 256], hits
    finally:
        holder.kill(signal.SIGKILL)
