"""kvcellard as a process: listeners, health, reflection, metrics, shutdown, kvcellarctl, TLS.

Every test starts the real daemon on temp sockets and an ephemeral HTTP port.
Interpreter: Debian's /usr/bin/python3 (python3-grpcio, python3-pytest).
"""
import os
import signal
import socket
import stat
import subprocess
import time
import urllib.request

import grpc
import pytest

from conftest import KVCELLARCTL, KVCELLARD, Daemon, parse_log_line, run

from grpc_stubs import health_pb2, health_pb2_grpc
from grpc_stubs import reflection_pb2, reflection_pb2_grpc
from kvcellar.v1 import admin_service_pb2, admin_service_pb2_grpc
from kvcellar.v1 import cache_service_pb2, cache_service_pb2_grpc, common_pb2


def channel(path):
    return grpc.insecure_channel(f"unix:{path}")


def http_get(address, path):
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, r.headers.get("Content-Type"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read().decode()


def test_health_service_reports_serving(daemon):
    for path in (daemon.socket, daemon.admin_socket):
        stub = health_pb2_grpc.HealthStub(channel(path))
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def list_services(path):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel(path))
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                        timeout=5)
    return sorted(s.name for r in replies for s in r.list_services_response.service)


def test_reflection_lists_every_service(daemon):
    assert list_services(daemon.socket) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "kvcellar.v1.AdminService",
        "kvcellar.v1.CacheService",
    ]
    # The admin socket serves AdminService, not the data path.
    assert list_services(daemon.admin_socket) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "kvcellar.v1.AdminService",
    ]


def test_reflection_describes_the_api(daemon):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel(daemon.socket))
    req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvcellar.v1.CacheService")
    reply = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=5)))
    assert reply.file_descriptor_response.file_descriptor_proto, reply


def test_metrics_pass_promtool_and_count_rpcs(daemon):
    stub = admin_service_pb2_grpc.AdminServiceStub(channel(daemon.socket))
    for _ in range(3):
        stub.GetStatus(admin_service_pb2.GetStatusRequest(), timeout=5)
    code, ctype, body = http_get(daemon.http, "/metrics")
    assert code == 200
    assert ctype.startswith("text/plain; version=0.0.4")
    assert 'kvcellar_build_info{' in body
    assert "process_resident_memory_bytes" in body
    line = [l for l in body.splitlines() if l.startswith("kvcellar_rpc_requests_total{")
            and 'method="GetStatus"' in l and 'code="OK"' in l]
    assert line and float(line[0].split()[-1]) == 3, body
    assert 'kvcellar_rpc_duration_seconds_count{service="kvcellar.v1.AdminService",method="GetStatus"} 3' in body
    res = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "" and res.stderr.strip() == "", res


def test_healthz_and_readyz(daemon):
    assert http_get(daemon.http, "/healthz")[0] == 200
    assert http_get(daemon.http, "/readyz")[0] == 200
    assert http_get(daemon.http, "/nope")[0] == 404


def test_prefetch_from_an_unknown_session_is_refused(daemon):
    stub = cache_service_pb2_grpc.CacheServiceStub(channel(daemon.socket))
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefetch(cache_service_pb2.PrefetchRequest(session_id=77), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "session_id 77" in err.value.details()


def test_mutating_admin_rpc_refused_on_engine_socket(daemon):
    stub = admin_service_pb2_grpc.AdminServiceStub(channel(daemon.socket))
    with pytest.raises(grpc.RpcError) as err:
        stub.Clear(admin_service_pb2.ClearRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "admin socket" in err.value.details()


def test_sockets_have_configured_modes(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(daemon.admin_socket).st_mode) == 0o600


def test_numeric_socket_group(daemon_factory):
    gid = os.getgid()
    d = daemon_factory(name="grp", args=["--set", f"listen.unix_socket_group={gid + 4242}"])
    # Root may give the socket to any gid, including one with no /etc/group entry (fsGroup).
    if os.geteuid() == 0:
        assert os.stat(d.socket).st_gid == gid + 4242


def test_status_reports_listeners_and_digest(daemon):
    stub = admin_service_pb2_grpc.AdminServiceStub(channel(daemon.admin_socket))
    status = stub.GetStatus(admin_service_pb2.GetStatusRequest(), timeout=5)
    assert status.ready and not status.draining
    # The limits engines are given at registration, all of them.
    assert status.limits.max_batch_pages == 65536 and status.limits.max_pin_lease_ms > 0
    assert status.limits.max_layers > 0 and status.limits.max_wait_ms > 0
    addresses = {l.address for l in status.listeners}
    assert {daemon.socket, daemon.admin_socket, daemon.http} <= addresses
    config = stub.GetConfig(admin_service_pb2.GetConfigRequest(), timeout=5)
    assert config.config_digest == status.config_digest == daemon.ready["config_digest"]
    assert f'unix_socket: "{daemon.socket}"' in config.yaml


def test_sigterm_drains_and_exits_zero(daemon_factory):
    daemon = daemon_factory(args=["--set", "server.drain_timeout_ms=2000"])
    t0 = time.monotonic()
    assert daemon.stop(signal.SIGTERM, timeout=10) == 0
    assert time.monotonic() - t0 < 2.5
    assert not os.path.exists(daemon.socket), "socket left behind after a clean shutdown"
    assert any(parse_log_line(l).get("msg") == "drained" for l in daemon.lines)


def test_sigint_exits_zero(daemon):
    assert daemon.stop(signal.SIGINT, timeout=10) == 0


def test_stale_socket_is_replaced(daemon_factory, tmp_path):
    first = daemon_factory(name="stale")
    first.stop(signal.SIGKILL)
    assert os.path.exists(first.socket), "SIGKILL should leave the socket file behind"
    second = daemon_factory(name="stale")  # same paths
    assert health_pb2_grpc.HealthStub(channel(second.socket)).Check(
        health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_live_daemon_on_same_socket_is_a_startup_error(daemon_factory):
    first = daemon_factory(name="live")
    second = daemon_factory(name="live", wait=False)
    assert second.proc.wait(20) == 1
    assert "another process" in second.log() and first.socket in second.log()
    # The first daemon is untouched.
    assert health_pb2_grpc.HealthStub(channel(first.socket)).Check(
        health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_regular_file_at_socket_path_is_refused(tmp_path):
    path = tmp_path / "kvcellard.sock"
    path.write_text("precious")
    d = Daemon(tmp_path).start(wait=False)
    assert d.proc.wait(20) == 1
    assert "not a socket" in d.log()
    assert path.read_text() == "precious"


def test_check_config(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("pool:\n  capacity: 2GiB\nlog:\n  level: debug\n")
    res = run([KVCELLARD, "--config", str(good), "--check-config"])
    assert res.returncode == 0, res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("pool:\n  capacty: 2GiB\n")
    res = run([KVCELLARD, "--config", str(bad), "--check-config"])
    assert res.returncode == 1
    assert "pool.capacty" in res.stderr and "pool.capacity" in res.stderr
    res = run([KVCELLARD, "--check-config", "--set", "pool.high_watermark=1.5"])
    assert res.returncode == 1 and "pool.high_watermark" in res.stderr
    assert run([KVCELLARD, "--bogus"]).returncode == 2


def test_kvcellarctl_status_live_and_missing(daemon, tmp_path):
    res = run([KVCELLARCTL, "--addr", daemon.socket, "status"])
    assert res.returncode == 0, res.stderr
    assert "kvcellard 0." in res.stdout and "ready" in res.stdout
    assert daemon.ready["config_digest"] in res.stdout
    assert daemon.socket in res.stdout and daemon.http in res.stdout
    res = run([KVCELLARCTL, "--addr", daemon.socket, "--json", "status"])
    assert res.returncode == 0 and '"config_digest"' in res.stdout
    missing = str(tmp_path / "nobody.sock")
    res = run([KVCELLARCTL, "--addr", missing, "--timeout-ms", "1000", "status"])
    assert res.returncode == 1
    assert "cannot reach kvcellard" in res.stderr and missing in res.stderr
    assert run([KVCELLARCTL, "frobnicate"]).returncode == 2


def make_pki(d):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    def ossl(*args):
        run(["openssl", *args], check=True, cwd=d)
    ossl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=kvcellar-test-ca")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        ossl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext")
    return {k: str(d / k) for k in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def tcp_address(d):
    line = [l for l in d.lines if parse_log_line(l).get("msg") == "ready"][0]
    return parse_log_line(line)["tcp"]


def test_tls_and_mutual_tls(daemon_factory, tmp_path):
    pki = make_pki(tmp_path)
    read = lambda k: open(pki[k], "rb").read()
    # TLS: a client trusting the CA gets in; a plaintext client does not.
    tls = daemon_factory(name="tls", subdir="tls", args=[
        "--set", "listen.tcp_address=127.0.0.1:0", "--set", "tls.mode=tls",
        "--set", f"tls.cert_file={pki['server.crt']}", "--set", f"tls.key_file={pki['server.key']}"])
    addr = tcp_address(tls)
    creds = grpc.ssl_channel_credentials(root_certificates=read("ca.crt"))
    stub = admin_service_pb2_grpc.AdminServiceStub(grpc.secure_channel(addr, creds))
    assert stub.GetStatus(admin_service_pb2.GetStatusRequest(), timeout=5).ready
    with pytest.raises(grpc.RpcError) as err:
        admin_service_pb2_grpc.AdminServiceStub(grpc.insecure_channel(addr)).GetStatus(
            admin_service_pb2.GetStatusRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    res = run([KVCELLARCTL, "--addr", addr, "--ca", pki["ca.crt"], "status"])
    assert res.returncode == 0 and "tls" in res.stdout, res.stderr

    # Mutual TLS: the client certificate is required.
    mtls = daemon_factory(name="mtls", subdir="mtls", args=[
        "--set", "listen.tcp_address=127.0.0.1:0", "--set", "tls.mode=mtls",
        "--set", f"tls.cert_file={pki['server.crt']}", "--set", f"tls.key_file={pki['server.key']}",
        "--set", f"tls.client_ca_file={pki['ca.crt']}"])
    addr = tcp_address(mtls)
    with_cert = grpc.ssl_channel_credentials(read("ca.crt"), read("client.key"), read("client.crt"))
    stub = admin_service_pb2_grpc.AdminServiceStub(grpc.secure_channel(addr, with_cert))
    status = stub.GetStatus(admin_service_pb2.GetStatusRequest(), timeout=5)
    assert any(l.security == admin_service_pb2.LISTENER_SECURITY_MTLS for l in status.listeners)
    no_cert = grpc.ssl_channel_credentials(read("ca.crt"))
    with pytest.raises(grpc.RpcError) as err:
        admin_service_pb2_grpc.AdminServiceStub(grpc.secure_channel(addr, no_cert)).GetStatus(
            admin_service_pb2.GetStatusRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    res = run([KVCELLARCTL, "--addr", addr, "--ca", pki["ca.crt"], "--timeout-ms", "2000", "status"])
    assert res.returncode == 1
    res = run([KVCELLARCTL, "--addr", addr, "--ca", pki["ca.crt"], "--cert", pki["client.crt"],
               "--key", pki["client.key"], "status"])
    assert res.returncode == 0, res.stderr
    # A verified client certificate is an admin identity: Clear passes the permission check
    # (and reaches the handler), where the same call over plain TLS is refused.
    try:
        stub.Clear(admin_service_pb2.ClearRequest(), timeout=5)
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.PERMISSION_DENIED, e
    tls_stub = admin_service_pb2_grpc.AdminServiceStub(grpc.secure_channel(
        tcp_address(tls), grpc.ssl_channel_credentials(read("ca.crt"))))
    with pytest.raises(grpc.RpcError) as err:
        tls_stub.Clear(admin_service_pb2.ClearRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_connection_over_the_per_uid_bound_is_told_why_and_counted(daemon_factory):
    """Issue #24: past listen.max_connections_per_uid a grpcio client saw only "Broken pipe".
    Now its call fails UNAVAILABLE with the bound in the message, each refusal is counted under
    the uid, and the log says why once."""
    d = daemon_factory(name="peruid", args=["--set", "listen.max_connections_per_uid=2"])
    held = []
    for _ in range(2):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket)
        held.append(s)
    time.sleep(0.2)  # Accepted, and counted, before the next.
    try:
        for _ in range(3):
            stub = health_pb2_grpc.HealthStub(channel(d.socket))
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert time.monotonic() - start < 2, "answered at once, not left to its deadline"
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            print("a refused grpcio client sees:", err.value.code(), err.value.details())
            assert (f"kvcellard refused the connection: uid {os.getuid()} already holds 2 "
                    "connections to this socket (listen.max_connections_per_uid)"
                    in err.value.details()), err.value.details()
    finally:
        for s in held:
            s.close()
    body = http_get(d.http, "/metrics")[2]
    line = [l for l in body.splitlines()
            if l.startswith(f'kvcellar_unix_connections_refused_total{{uid="{os.getuid()}"}} ')]
    assert line and float(line[0].split()[-1]) >= 3, body[-3000:]
    refusals = [l for l in d.lines if "connection refused, the user holds its maximum" in l]
    assert len(refusals) == 1, refusals
    # Once the held ones are gone, the user is served again.
    stub = health_pb2_grpc.HealthStub(channel(d.socket))
    deadline = time.monotonic() + 10
    while True:
        try:
            stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


# Scrapers in a process of their own, so that their reading does not slow this one's probes.
SCRAPE_BURST = r"""
import socket, sys, threading
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conns = [socket.create_connection((host, port), timeout=30) for _ in range(n)]
for c in conns:
    c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
sizes = []
def read(c):
    total = 0
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        total += len(d)
    sizes.append(total)
threads = [threading.Thread(target=read, args=(c,)) for c in conns]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(sizes), min(sizes), max(sizes))
"""


def probe(address):
    """Seconds one GET /healthz takes, on a fresh connection; asserts 200."""
    host, port = address.rsplit(":", 1)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while True:
            d = s.recv(4096)
            if not d:
                break
            reply += d
    assert reply.startswith(b"HTTP/1.1 200"), reply
    return time.monotonic() - start


def test_healthz_stays_prompt_under_a_burst_of_scrapes(daemon_factory):
    """Issue #24: 200 simultaneous /metrics scrapes of a large exposition (many namespaces)
    delayed /healthz by up to 1.8 s. Probes during such a burst must answer within 200 ms."""
    namespaces, scrapers, bound_s = 9000, 200, 0.2
    d = daemon_factory(name="scrapes", args=["--set", f"http.max_namespace_series={namespaces}",
                                             "--set", "sessions.lease_ms=120000"])
    stub = cache_service_pb2_grpc.CacheServiceStub(channel(d.socket))
    futures = []
    for i in range(namespaces):
        r = cache_service_pb2.RegisterEngineRequest(instance_id=f"scrape-{i}",
                                                    role=common_pb2.SESSION_ROLE_SCHEDULER)
        r.namespace_spec.tenant = "team-a"
        r.namespace_spec.model_id = f"model-{i:05d}"
        r.namespace_spec.model_revision = "r1"
        r.namespace_spec.kv_dtype = "bf16"
        r.namespace_spec.page_size_tokens = 16
        r.namespace_spec.layout_kind = common_pb2.LAYOUT_KIND_MHA_GQA
        r.namespace_spec.tp_size = 1
        futures.append(stub.RegisterEngine.future(r, timeout=60))
        if len(futures) >= 64:
            futures.pop(0).result()
    for f in futures:
        f.result()
    exposition = http_get(d.http, "/metrics")[2]
    assert f"model-{namespaces - 1:05d}" in exposition
    host, port = d.http.rsplit(":", 1)
    burst = subprocess.Popen(["/usr/bin/python3", "-c", SCRAPE_BURST, host, port, str(scrapers)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latencies = []
    while burst.poll() is None:
        latencies.append(probe(d.http))
        time.sleep(0.005)
    out, err = burst.communicate()
    assert burst.returncode == 0, err
    n, smallest, largest = map(int, out.split())
    assert n == scrapers and smallest > len(exposition) // 2, out
    latencies.sort()
    print(f"healthz during {scrapers} scrapes of {len(exposition)} bytes: {len(latencies)} probes, "
          f"p50 {latencies[len(latencies) // 2] * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms")
    assert latencies[-1] < bound_s, latencies[-10:]
