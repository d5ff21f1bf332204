"""AdminService end to end: a real kvcellard on the sim device, real engine processes
(kvcellar-engine-sim) backing up and loading pages, and the admin RPCs through Python gRPC and
through kvcellarctl (tables and --json)."""
import json
import os
import subprocess

import grpc
import pytest

from conftest import BIN_DIR
from engine_sim import (DAEMON_ARGS, EXIT_OK, EngineProcess, admin, require_cache_service,
                        run_engine)

from kvcellar.v1 import admin_service_pb2 as pb

GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16)
PAGE_BYTES = 2 * 2 * 4096  # MHA, TP 1: one object per page, K and V of 2 layers.
L2 = pb.TIER_L2


@pytest.fixture
def cache_daemon(daemon_factory):
    d = daemon_factory(args=DAEMON_ARGS)
    require_cache_service(d)
    return d


def ctl(daemon, *args, admin_socket=True):
    sock = daemon.admin_socket if admin_socket else daemon.socket
    p = subprocess.run([os.path.join(BIN_DIR, "kvcellarctl"), "--addr", sock, *args],
                       capture_output=True, text=True, timeout=30)
    return p


def backup(sock, tokens_seed, pages, model="m1", tenant="team-a", seed=7):
    r = run_engine(sock, "backup", instance=f"w-{model}-{tokens_seed}", rank=0, tp=1, seed=seed,
                   tokens_seed=tokens_seed, pages=pages, model=model, tenant=tenant, **GEOMETRY)
    assert r.rc == EXIT_OK and r["stored"] == pages, r.describe()
    return r


def load(sock, tokens_seed, pages, model="m1", tenant="team-a", seed=7, **kw):
    r = run_engine(sock, "load", instance=f"r-{model}-{tokens_seed}", rank=0, tp=1,
                   verify_seed=seed, tokens_seed=tokens_seed, pages=pages, model=model,
                   tenant=tenant, first_block=32, **GEOMETRY, **kw)
    assert r.rc == EXIT_OK, r.describe()
    assert r["mismatched_bytes"] == 0
    assert r["verified_bytes"] == r["loaded"] * PAGE_BYTES
    return r


def ns_by_model(daemon):
    listed = admin(daemon).ListNamespaces(pb.ListNamespacesRequest(), timeout=5).namespaces
    return {n.spec.model_id: n for n in listed}


def l2_usage(ns):
    return [t for t in ns.tiers if t.tier == L2][0]


def trailer(err, key):
    return dict(err.trailing_metadata() or ()).get(key)


def test_admin_lists_evicts_and_clears_what_engines_did(cache_daemon):
    d = cache_daemon
    sock = d.socket
    a = backup(sock, tokens_seed=31, pages=8)            # Prompt A: 8 pages.
    backup(sock, tokens_seed=32, pages=4)                # Prompt B: 4 pages, same namespace.
    backup(sock, tokens_seed=33, pages=4, model="m2", tenant="t2")
    digest = a["session"]["ns_digest"]
    first_key_a = a["first_key"]
    assert load(sock, 31, 8, expect_hits=8)["loaded"] == 8
    assert load(sock, 34, 2)["hits"] == 0                # Two pages looked up, both miss.

    # Namespaces: sizes and hit rates match what the engines did.
    ns = ns_by_model(d)
    assert set(ns) == {"m1", "m2"}
    m1 = ns["m1"]
    assert m1.spec.tenant == "team-a" and m1.num_shards == 1 and m1.page_object_bytes == PAGE_BYTES
    assert bytes(m1.ns_digest).hex() == digest
    u = l2_usage(m1)
    assert (u.pages, u.objects, u.bytes) == (12, 12, 12 * PAGE_BYTES)
    assert l2_usage(ns["m2"]).pages == 4
    assert m1.lookup_pages == 10 and m1.l2_hit_pages == 8
    assert m1.hit_rate == pytest.approx(0.8)
    assert m1.last_access_unix_ms > 0
    only_t2 = admin(d).ListNamespaces(
        pb.ListNamespacesRequest(tenant=pb.TenantFilter(tenant="t2")), timeout=5).namespaces
    assert [n.spec.model_id for n in only_t2] == ["m2"]

    # A live engine holding a pin on prompt B.
    holder = EngineProcess(sock, "hold", instance="holder", rank=0, tp=1, tokens_seed=32, pages=4,
                           pin=True, model="m1", tenant="team-a", **GEOMETRY)
    try:
        held = holder.first_line()
        assert held["hits"] == 4 and held["pin_id"] != 0
        sessions = admin(d).ListEngines(pb.ListEnginesRequest(instance_id="holder"),
                                        timeout=5).sessions
        assert len(sessions) == 1
        s = sessions[0]
        assert s.pins == 1 and s.pinned_pages == 4 and s.namespace_spec.model_id == "m1"
        assert bytes(s.ns_digest).hex() == digest and s.num_blocks == GEOMETRY["blocks"]
        table = ctl(d, "engines")
        assert table.returncode == 0 and "holder" in table.stdout and "INSTANCE" in table.stdout

        # Stats: the same counters as /metrics, overall and per namespace.
        stats = admin(d).GetStats(pb.GetStatsRequest(per_namespace=True), timeout=5)
        assert stats.totals.match.l2_hit_pages >= 12
        per = {n.model_id: n.counters for n in stats.namespaces}
        assert per["m1"].match.lookup_pages == 10 + 4 and per["m1"].match.l2_hit_pages == 8 + 4
        st = json.loads(ctl(d, "stats", "--per-namespace", "--json").stdout)
        assert "totals" in st and len(st["namespaces"]) == 2

        # Dry run over the namespace: prompt A goes, prompt B is pinned; nothing changes.
        scope = pb.Scope(ns_digest=bytes.fromhex(digest))
        dry = admin(d).Evict(pb.EvictRequest(scope=scope, tiers=[L2], dry_run=True), timeout=10)
        assert dry.dry_run and dry.evicted[0].pages == 8 and dry.evicted[0].bytes == 8 * PAGE_BYTES
        assert dry.skipped_pinned_pages == 4
        assert l2_usage(ns_by_model(d)["m1"]).pages == 12

        # Subtree of prompt A with a target of two pages: its last two pages go (leaf first).
        r = admin(d).Evict(pb.EvictRequest(
            scope=pb.Scope(ns_digest=bytes.fromhex(digest),
                           subtree_root_key=bytes.fromhex(first_key_a)),
            tiers=[L2], target_bytes=2 * PAGE_BYTES), timeout=10)
        assert not r.dry_run and r.evicted[0].pages == 2 and r.evicted[0].bytes == 2 * PAGE_BYTES
        assert l2_usage(ns_by_model(d)["m1"]).pages == 10
        after = load(sock, 31, 8)
        assert after["hits"] == 6 and after["loaded"] == 6  # Still byte-exact (checked in load).
        assert load(sock, 32, 4, expect_hits=4)["loaded"] == 4  # Prompt B untouched.

        # By tenant, through kvcellarctl --json: all of m2.
        out = ctl(d, "evict", "--tenant", "t2", "--json")
        assert out.returncode == 0, out.stderr
        ev = json.loads(out.stdout)
        assert int(ev["evicted"][0]["pages"]) == 4
        assert l2_usage(ns_by_model(d)["m2"]).pages == 0
        # TIER_L3 with no L3 configured: accepted, nothing to report.
        l3 = admin(d).Evict(pb.EvictRequest(tiers=[pb.TIER_L3]), timeout=5)
        assert list(l3.evicted) == []

        # Clear without confirm is refused (kvcellarctl and gRPC); dry run needs no confirm.
        refused = ctl(d, "clear", "--namespace", digest)
        assert refused.returncode == 1 and "--yes" in refused.stderr
        with pytest.raises(grpc.RpcError) as err:
            admin(d).Clear(pb.ClearRequest(scope=scope, tiers=[L2]), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert trailer(err.value, "kvcellar-error-reason") == "ERROR_REASON_CONFIRM_REQUIRED"
        preview = admin(d).Clear(pb.ClearRequest(scope=scope, tiers=[L2], dry_run=True),
                                 timeout=5)
        assert preview.removed[0].pages == 10 and preview.pins_revoked == 1
        assert l2_usage(ns_by_model(d)["m1"]).pages == 10

        # Clear for real (table output): revokes the holder's pin and removes everything.
        done = ctl(d, "clear", "--namespace", digest, "--yes")
        assert done.returncode == 0, done.stderr
        assert "pins revoked: 1" in done.stdout and "TIER" in done.stdout
        assert l2_usage(ns_by_model(d)["m1"]).pages == 0
        assert load(sock, 32, 4)["hits"] == 0
        assert load(sock, 31, 8)["hits"] == 0
        assert admin(d).GetStatus(pb.GetStatusRequest(), timeout=5).pool.used_bytes == 0
    finally:
        holder.kill()

    # The cache works again after a Clear: back up and load byte-exact.
    backup(sock, tokens_seed=31, pages=8)
    assert load(sock, 31, 8, expect_hits=8)["loaded"] == 8


def test_admin_validation_names_the_field(cache_daemon):
    stub = admin(cache_daemon)
    cases = [
        (lambda: stub.Evict(pb.EvictRequest(scope=pb.Scope(ns_digest=b"short"), tiers=[L2]),
                            timeout=5), "scope.ns_digest"),
        (lambda: stub.Evict(pb.EvictRequest(scope=pb.Scope(subtree_root_key=b"x" * 31),
                                            tiers=[L2]), timeout=5), "scope.subtree_root_key"),
        (lambda: stub.Evict(pb.EvictRequest(tiers=[pb.TIER_L1]), timeout=5), "tiers[0]"),
        (lambda: stub.Evict(pb.EvictRequest(tiers=[L2, 9]), timeout=5), "tiers[1]"),
        (lambda: stub.Evict(pb.EvictRequest(), timeout=5), "tiers"),
        (lambda: stub.Clear(pb.ClearRequest(tiers=[pb.TIER_L3], l3_backends=["nvme"],
                                            confirm=True), timeout=5), "l3_backends[0]"),
        (lambda: stub.GetStats(pb.GetStatsRequest(ns_digest=b"abc"), timeout=5), "ns_digest"),
        (lambda: stub.ListEngines(pb.ListEnginesRequest(ns_digest=b"abc"), timeout=5),
         "ns_digest"),
    ]
    for call, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert trailer(err.value, "kvcellar-error-field") == field
        assert field.split("[")[0] in err.value.details()
    bad = ctl(cache_daemon, "evict", "--namespace", "xyz")
    assert bad.returncode == 2 and "64 hex digits" in bad.stderr


def test_engine_socket_serves_reads_and_refuses_changes(cache_daemon):
    stub = admin(cache_daemon)
    engine = __import__("engine_sim").admin_service_pb2_grpc.AdminServiceStub(
        grpc.insecure_channel(f"unix:{cache_daemon.socket}"))
    engine.ListNamespaces(pb.ListNamespacesRequest(), timeout=5)
    engine.ListEngines(pb.ListEnginesRequest(), timeout=5)
    engine.GetStats(pb.GetStatsRequest(), timeout=5)
    for call in (lambda: engine.Evict(pb.EvictRequest(tiers=[L2]), timeout=5),
                 lambda: engine.Clear(pb.ClearRequest(tiers=[L2], confirm=True), timeout=5)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert trailer(err.value, "kvcellar-error-reason") == "ERROR_REASON_ADMIN_REQUIRED"
    refused = ctl(cache_daemon, "evict", admin_socket=False)
    assert refused.returncode == 1 and "ADMIN_REQUIRED" in refused.stderr
    assert stub.Evict(pb.EvictRequest(tiers=[L2]), timeout=5).evicted[0].pages == 0


def test_admin_rpcs_through_reflection_alone(cache_daemon):
    """What grpcurl does: no generated stubs, only descriptors fetched through reflection."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from grpc_stubs import reflection_pb2, reflection_pb2_grpc

    backup(cache_daemon.socket, tokens_seed=71, pages=3)

    def described(sock):
        stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(f"unix:{sock}"))
        req = reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="kvcellar.v1.AdminService")
        reply = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=5)))
        pool = descriptor_pool.DescriptorPool()
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in reply.file_descriptor_response.file_descriptor_proto]
        added = set()
        while len(added) < len(files):  # Dependencies before the files that import them.
            for f in files:
                if f.name not in added and all(d in added for d in f.dependency):
                    pool.Add(f)
                    added.add(f.name)
        factory = message_factory.MessageFactory(pool)
        service = pool.FindServiceByName("kvcellar.v1.AdminService")

        def call(method, sock_path, **fields):
            m = service.FindMethodByName(method)
            req_cls = factory.GetPrototype(m.input_type)
            resp_cls = factory.GetPrototype(m.output_type)
            rpc = grpc.insecure_channel(f"unix:{sock_path}").unary_unary(
                f"/kvcellar.v1.AdminService/{method}",
                request_serializer=lambda msg: msg.SerializeToString(),
                response_deserializer=resp_cls.FromString)
            return rpc(req_cls(**fields), timeout=10)
        return call, pool

    call, pool = described(cache_daemon.admin_socket)
    listed = call("ListNamespaces", cache_daemon.admin_socket)
    assert any(n.spec.model_id == "m1" for n in listed.namespaces)
    stats = call("GetStats", cache_daemon.admin_socket)
    assert stats.totals.match.calls >= 0
    config = call("GetConfig", cache_daemon.admin_socket)
    assert "pool:" in config.yaml
    l2 = pool.FindEnumTypeByName("kvcellar.v1.Tier").values_by_name["TIER_L2"].number
    with pytest.raises(grpc.RpcError) as err:
        call("Clear", cache_daemon.admin_socket, tiers=[l2])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    cleared = call("Clear", cache_daemon.admin_socket, tiers=[l2], confirm=True)
    assert sum(u.pages for u in cleared.removed) >= 3, cleared
    # The same call on the engine socket is refused: not an admin identity.
    with pytest.raises(grpc.RpcError) as err:
        call("Evict", cache_daemon.socket, tiers=[l2])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
