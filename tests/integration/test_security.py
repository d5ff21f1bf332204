"""Sessions and tenants bound to who connects (issue #13, defect 2), with real daemons and real
engine processes (kvcellar-engine-sim), attacked from this test's own process.

- A session id is no bearer credential: the daemon binds each session to the peer that
  registered it (Unix socket: uid, gid and pid from SO_PEERCRED; mutual TLS: the certificate
  subject), so another process holding a stolen id can neither match, release the owner's pin,
  heartbeat nor unregister it, and the owner carries on unharmed.
- Tenants are granted by the operator (tenants.allow), not self-declared: a peer registering a
  tenant not granted to it gets PERMISSION_DENIED / ERROR_REASON_TENANT_DENIED, and nothing of
  the refused registration stays behind.
Interpreter: Debian's /usr/bin/python3 (python3-grpcio, python3-pytest).
"""
import os

import grpc
import pytest

from engine_sim import (DAEMON_ARGS, EXIT_OK, EXIT_SETUP, EngineProcess, admin, require_cache_service,
                        run_engine)
from test_daemon import make_pki, tcp_address

from kvcellar.v1 import admin_service_pb2 as apb
from kvcellar.v1 import cache_service_pb2 as cpb
from kvcellar.v1 import cache_service_pb2_grpc
from kvcellar.v1 import common_pb2

GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="sec-model")
PAGE_BYTES = 2 * 2 * 4096


def engine_stub(sock):
    return cache_service_pb2_grpc.CacheServiceStub(grpc.insecure_channel(f"unix:{sock}"))


def refused(call, reason):
    """Runs `call`, which must fail with PERMISSION_DENIED and `reason`; returns the error."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    e = err.value
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (e.code(), e.details())
    md = dict(e.trailing_metadata() or ())
    assert md.get("kvcellar-error-reason") == reason, md
    return e, md


def scheduler_registration(tenant, instance):
    """A SCHEDULER registration: no engine memory, so any process can send it."""
    return cpb.RegisterEngineRequest(
        instance_id=instance, role=common_pb2.SESSION_ROLE_SCHEDULER,
        namespace_spec=common_pb2.NamespaceSpec(
            tenant=tenant, model_id="sec-model", model_revision="r1", kv_dtype="bf16",
            page_size_tokens=16,
            layout_kind=common_pb2.LAYOUT_KIND_MHA_GQA, tp_size=1))


def test_a_stolen_session_id_is_useless_to_another_process(daemon_factory):
    d = daemon_factory(args=DAEMON_ARGS)
    require_cache_service(d)
    sock = d.socket
    stored = run_engine(sock, "backup", instance="writer", rank=0, tp=1, seed=5, tokens_seed=11,
                        pages=4, tenant="team-a", **GEOMETRY)
    assert stored.rc == EXIT_OK and stored["stored"] == 4, stored.describe()

    # The victim: an engine of team-a holding a pin on those 4 pages.
    holder = EngineProcess(sock, "hold", instance="victim", rank=0, tp=1, tokens_seed=11, pages=4,
                           pin=True, hold_s=4, tenant="team-a", **GEOMETRY)
    held = holder.first_line()
    assert held["hits"] == 4 and held["pin_id"] != 0, held
    # How the attacker got the id does not matter (engine-socket listings no longer show ids;
    # the admin socket does): holding it must give nothing.
    victim = admin(d).ListEngines(apb.ListEnginesRequest(instance_id="victim"), timeout=5).sessions
    assert len(victim) == 1 and victim[0].session_id != 0
    sid = victim[0].session_id
    assert victim[0].peer.startswith("uid ") and f"pid {holder.proc.pid}" in victim[0].peer

    stub = engine_stub(sock)
    owner = "ERROR_REASON_NOT_SESSION_OWNER"
    # 1. Match as the victim (an L2 hit of team-a's pages before the fix).
    e, md = refused(lambda: stub.Match(cpb.MatchRequest(session_id=sid), timeout=5), owner)
    assert md.get("kvcellar-error-field") == "session_id"
    assert f"pid {os.getpid()}" in e.details() and f"pid {holder.proc.pid}" not in e.details()
    # 2. Release the victim's pin, 3. keep its lease alive, 4. unregister it.
    refused(lambda: stub.Release(cpb.ReleaseRequest(session_id=sid, pin_ids=[held["pin_id"]]),
                                 timeout=5), owner)
    refused(lambda: stub.Heartbeat(cpb.HeartbeatRequest(session_id=sid), timeout=5), owner)
    refused(lambda: stub.UnregisterEngine(cpb.UnregisterEngineRequest(session_id=sid),
                                          timeout=5), owner)
    for call in (lambda: stub.Prefetch(cpb.PrefetchRequest(session_id=sid), timeout=5),
                 lambda: stub.Load(cpb.LoadRequest(session_id=sid), timeout=5),
                 lambda: stub.Backup(cpb.BackupRequest(session_id=sid), timeout=5),
                 lambda: stub.WaitOps(cpb.WaitOpsRequest(session_id=sid, op_ids=[1]), timeout=5)):
        refused(call, owner)

    # Nothing changed: the session and its pin are there.
    after = admin(d).ListEngines(apb.ListEnginesRequest(instance_id="victim"), timeout=5).sessions
    assert len(after) == 1 and after[0].session_id == sid
    assert after[0].pins == 1 and after[0].pinned_pages == 4
    # The victim carries on: it ends its hold and unregisters itself.
    r = holder.finish()
    assert r.rc == EXIT_OK, r.describe()
    assert len(admin(d).ListEngines(apb.ListEnginesRequest(instance_id="victim"),
                                    timeout=5).sessions) == 0
    # And an engine of team-a loads the pages, every byte verified.
    r = run_engine(sock, "load", instance="reader", rank=0, tp=1, verify_seed=5, tokens_seed=11,
                   pages=4, first_block=32, tenant="team-a", **GEOMETRY)
    assert r.rc == EXIT_OK and r["loaded"] == 4 and r["mismatched_bytes"] == 0, r.describe()
    assert r["verified_bytes"] == 4 * PAGE_BYTES

    # The attacker's own session works: being refused someone else's is not being locked out.
    mine = stub.RegisterEngine(scheduler_registration("team-a", "attacker"), timeout=5)
    hb = stub.Heartbeat(cpb.HeartbeatRequest(session_id=mine.session_id), timeout=5)
    assert hb.state == cpb.SESSION_STATE_ACTIVE


def test_tenants_are_granted_by_the_operator_not_self_declared(daemon_factory):
    me = os.getuid()
    other = me + 4242
    d = daemon_factory(args=[*DAEMON_ARGS, "--set",
                             f"tenants.allow=team-a=uid:{other};team-b=uid:{me};"
                             f"=gid:{os.getgid()}"])
    require_cache_service(d)
    sock = d.socket
    stub = engine_stub(sock)
    denied = "ERROR_REASON_TENANT_DENIED"
    before = admin(d).ListNamespaces(apb.ListNamespacesRequest(), timeout=5).namespaces

    # team-a belongs to another uid: registering it is refused, naming the field and this peer.
    e, md = refused(lambda: stub.RegisterEngine(scheduler_registration("team-a", "a"), timeout=5),
                    denied)
    assert md.get("kvcellar-error-field") == "namespace_spec.tenant"
    assert "'team-a'" in e.details() and f"uid {me}" in e.details()
    # A tenant nobody was granted is refused too.
    refused(lambda: stub.RegisterEngine(scheduler_registration("team-z", "z"), timeout=5), denied)
    # An engine process of team-a (real memory, real registration) gets no session: the client
    # library reports the refusal at Register (a deployment error, not retried), so the engine
    # learns why at start instead of running on without a cache.
    r = run_engine(sock, "load", instance="intruder", rank=0, tp=1, verify_seed=5, tokens_seed=11,
                   pages=4, tenant="team-a", register_wait_ms=500, **GEOMETRY)
    assert r.rc == EXIT_SETUP and "TENANT_DENIED" in r.err + r.out, r.describe()
    # Nothing of the refused registrations stayed: no namespace, no session.
    assert list(admin(d).ListNamespaces(apb.ListNamespacesRequest(), timeout=5).namespaces) == \
        list(before)
    assert len(admin(d).ListEngines(apb.ListEnginesRequest(), timeout=5).sessions) == 0

    # team-b is granted to this uid, the empty tenant to this gid: both work, bytes verified.
    for tenant in ("team-b", ""):
        w = run_engine(sock, "backup", instance=f"w{tenant}", rank=0, tp=1, seed=9,
                       tokens_seed=12, pages=3, tenant=tenant, **GEOMETRY)
        assert w.rc == EXIT_OK and w["stored"] == 3, w.describe()
        r = run_engine(sock, "load", instance=f"r{tenant}", rank=0, tp=1, verify_seed=9,
                       tokens_seed=12, pages=3, first_block=32, tenant=tenant, **GEOMETRY)
        assert r.rc == EXIT_OK and r["loaded"] == 3 and r["mismatched_bytes"] == 0, r.describe()


def test_tenants_granted_to_a_client_certificate(daemon_factory, tmp_path):
    pki = make_pki(tmp_path)
    read = lambda k: open(pki[k], "rb").read()
    d = daemon_factory(args=[
        *DAEMON_ARGS, "--set", "listen.tcp_address=127.0.0.1:0", "--set", "tls.mode=mtls",
        "--set", f"tls.cert_file={pki['server.crt']}", "--set", f"tls.key_file={pki['server.key']}",
        "--set", f"tls.client_ca_file={pki['ca.crt']}",
        "--set", "tenants.allow=team-c=subject:CN=client;team-d=subject:CN=someone-else"])
    require_cache_service(d)
    creds = grpc.ssl_channel_credentials(read("ca.crt"), read("client.key"), read("client.crt"))
    stub = cache_service_pb2_grpc.CacheServiceStub(grpc.secure_channel(tcp_address(d), creds))
    ok = stub.RegisterEngine(scheduler_registration("team-c", "c"), timeout=5)
    assert ok.session_id != 0
    e, _ = refused(lambda: stub.RegisterEngine(scheduler_registration("team-d", "d"), timeout=5),
                   "ERROR_REASON_TENANT_DENIED")
    assert "certificate 'CN=client'" in e.details()
    # The certificate's session is bound to the certificate: the same id over the Unix socket
    # (another identity, though the same uid) is refused.
    refused(lambda: engine_stub(d.socket).Heartbeat(
        cpb.HeartbeatRequest(session_id=ok.session_id), timeout=5),
        "ERROR_REASON_NOT_SESSION_OWNER")
    assert stub.Heartbeat(cpb.HeartbeatRequest(session_id=ok.session_id),
                          timeout=5).state == cpb.SESSION_STATE_ACTIVE


def test_a_subject_grant_without_mtls_is_a_config_error(daemon_factory):
    from conftest import KVCELLARD, run
    res = run([KVCELLARD, "--check-config", "--set", "tenants.allow=team-c=subject:CN=client"])
    assert res.returncode != 0
    assert "tenants.allow" in res.stderr + res.stdout and "mtls" in res.stderr + res.stdout
    res = run([KVCELLARD, "--check-config", "--set", "tenants.allow=team-c=uid:no-such-user-x"])
    assert res.returncode != 0 and "no user 'no-such-user-x'" in res.stderr + res.stdout
