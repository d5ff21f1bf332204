"""No engine can stall the others (issue #24, deliverable 5), with a real daemon and real engine
processes (kvcellar-engine-sim).

UnregisterEngine gives a session's pending ops up to drain_timeout_ms to end. The daemon used to
wait for them on the gRPC thread that served the call; gRPC's callback threads are few (two on a
two-core machine), so a few engines unregistering at once froze every other engine's RPCs for
their whole drain, and bystanders' sessions lapsed. Here:

- Drainers (engine processes) each hold Backups whose ready signal never comes, then unregister
  at the same moment with a long drain: half of them with ops that stay pending past the drain
  (they are cancelled), half with ops that end within it (their ready deadline passes first).
- Meanwhile bystanders run: engines doing random Match/Load/Backup with every loaded byte
  verified and a short RPC deadline, and sessions this process heartbeats every 100 ms with a
  deadline well under the 1 s lease.
- Every bystander RPC must finish within its deadline and no session may lapse; each drainer's
  reply must still come after its drain, with the right counts.
- A daemon shutting down cuts a pending drain short: the reply (ops cancelled) comes at once and
  the daemon exits promptly (before, shutdown waited out the drain and the engine got
  UNAVAILABLE).

Interpreter: Debian's /usr/bin/python3 (python3-grpcio, python3-pytest).
"""
import json
import subprocess
import threading
import time

import grpc

from conftest import parse_log_line
from engine_sim import (EXIT_OK, SHM_PREFIX, engine_args, remove_engine_shm,
                        require_cache_service)

from kvcellar.v1 import cache_service_pb2 as cpb
from kvcellar.v1 import cache_service_pb2_grpc
from kvcellar.v1 import common_pb2

LEASE_MS = 1000
DAEMON_ARGS = (
    "--set", "device.kind=sim",
    "--set", f"sessions.lease_ms={LEASE_MS}",
    "--set", "sessions.pin_lease_ms=60000",
)
GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="iso-model")

# Drainers whose Backups stay pending past the drain: each unregisters with DRAIN_MS and gets its
# ops cancelled at the end of it.
STUCK_DRAINERS = 3
DRAIN_MS = 3000
# Drainers whose Backups end (TIMEOUT) within the drain, at their ready deadline: the reply comes
# then, with the ops counted completed. The deadline is counted from the Backup; "go" comes
# within a few seconds of it.
ENDING_DRAINERS = 2
ENDING_READY_MS = 6000
ENDING_DRAIN_MS = 9000
OPS_PER_DRAINER = 2

HEARTBEAT_SESSIONS = 3
HEARTBEAT_EVERY_S = 0.1
HEARTBEAT_DEADLINE_S = 0.5  # Half the lease: a heartbeat this late risks the session.
ENGINE_RPC_TIMEOUT_MS = 800  # The verified-traffic engines' deadline for every RPC.
BYSTANDER_SECONDS = 8


def scheduler_registration(instance):
    return cpb.RegisterEngineRequest(
        instance_id=instance, role=common_pb2.SESSION_ROLE_SCHEDULER,
        namespace_spec=common_pb2.NamespaceSpec(
            model_id="iso-model", model_revision="rev1", kv_dtype="bf16", page_size_tokens=16,
            layout_kind=common_pb2.LAYOUT_KIND_MHA_GQA, tp_size=1))


class Drainer:
    """A `drain` engine: its Backups pend until it is told to unregister (a line on stdin)."""

    def __init__(self, sock, name, ready_timeout_ms, drain_ms, tokens_seed):
        self.name, self.drain_ms = name, drain_ms
        self.cmd = engine_args(sock, "drain", instance=name, tokens_seed=tokens_seed, pages=2,
                               ops=OPS_PER_DRAINER, ready_timeout_ms=ready_timeout_ms,
                               drain_ms=drain_ms, rpc_timeout_ms=2000, shm_prefix=SHM_PREFIX,
                               **GEOMETRY)
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def line(self):
        out = self.proc.stdout.readline()
        assert out, f"{self.name} printed nothing (rc {self.proc.poll()}): {self.proc.stderr.read()}"
        return json.loads(out)

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout=30):
        reply = self.line()
        self.proc.wait(timeout=timeout)
        remove_engine_shm(self.proc.pid)
        return reply


class HeartbeatProbe(threading.Thread):
    """Heartbeats one scheduler session every HEARTBEAT_EVERY_S with HEARTBEAT_DEADLINE_S, and
    records each call's latency, error and session state."""

    def __init__(self, stub, session_id):
        super().__init__(daemon=True)
        self.stub, self.session_id = stub, session_id
        self.latencies, self.errors, self.states = [], [], []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                r = self.stub.Heartbeat(cpb.HeartbeatRequest(session_id=self.session_id),
                                        timeout=HEARTBEAT_DEADLINE_S)
                self.states.append(r.state)
            except grpc.RpcError as e:
                self.errors.append(f"{e.code()}: {e.details()}")
            self.latencies.append(time.monotonic() - start)
            self.stop.wait(HEARTBEAT_EVERY_S)


def test_unregistering_engines_with_pending_ops_stall_no_bystander(daemon_factory):
    d = daemon_factory(args=DAEMON_ARGS)
    require_cache_service(d)
    sock = d.socket

    # The drainers, their ops submitted and pending.
    drainers = [Drainer(sock, f"stuck-{i}", 30000, DRAIN_MS, 100 + i) for i in range(STUCK_DRAINERS)]
    drainers += [Drainer(sock, f"ending-{i}", ENDING_READY_MS, ENDING_DRAIN_MS, 200 + i)
                 for i in range(ENDING_DRAINERS)]
    for dr in drainers:
        first = dr.line()
        assert first["pending"] == OPS_PER_DRAINER, (dr.name, first)
    submitted = time.monotonic()

    # The bystanders: verified traffic, and heartbeats this process times.
    traffic = [subprocess.Popen(
        engine_args(sock, "random", instance=f"bystander-{i}", seed=7 + i, tokens_seed=50 + i,
                    docs=4, max_pages=4, duration_s=BYSTANDER_SECONDS, think_ms=20,
                    rpc_timeout_ms=ENGINE_RPC_TIMEOUT_MS, wait_ms=2000, shm_prefix=SHM_PREFIX,
                    **GEOMETRY),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    stub = cache_service_pb2_grpc.CacheServiceStub(grpc.insecure_channel(f"unix:{sock}"))
    probes = []
    for i in range(HEARTBEAT_SESSIONS):
        reg = stub.RegisterEngine(scheduler_registration(f"watcher-{i}"), timeout=5)
        probes.append(HeartbeatProbe(stub, reg.session_id))
    for p in probes:
        p.start()

    # Let the bystanders get going, then every drainer unregisters at once.
    time.sleep(1.0)
    for dr in drainers:
        dr.go()
    went = time.monotonic()
    assert went - submitted < ENDING_READY_MS / 1000 - 1, "too slow to start: the test is moot"
    replies = {dr.name: (dr, dr.finish()) for dr in drainers}
    results = [t.communicate(timeout=BYSTANDER_SECONDS + 30) for t in traffic]
    for p in probes:
        p.stop.set()
    for p in probes:
        p.join(timeout=5)

    # The figures first (pytest -s shows them), then the verdicts.
    latencies = sorted(x for p in probes for x in p.latencies)
    worst = latencies[-1]
    lapsed = [line for line in d.log().splitlines() if "lease expired" in line]
    print(f"\nheartbeats: {len(latencies)}, median {latencies[len(latencies) // 2] * 1000:.1f} ms, "
          f"max {worst * 1000:.1f} ms, past deadline {sum(len(p.errors) for p in probes)}, "
          f"not active {sum(s != cpb.SESSION_STATE_ACTIVE for p in probes for s in p.states)}; "
          f"sessions lapsed: {len(lapsed)}")
    for name, (dr, reply) in replies.items():
        print(f"{name}: unregister_ms {reply['unregister_ms']}, completed {reply['ops_completed']}, "
              f"cancelled {reply['ops_cancelled']}, pins {reply['pins_released']}")
    traffic_json = []
    for t, (out, err) in zip(traffic, results):
        lines = out.strip().splitlines()
        r = json.loads(lines[-1]) if lines else {}
        traffic_json.append(r)
        if r:
            print(f"bystander: steps {r['steps']}, loaded {r['loaded_pages']}, stored "
                  f"{r['stored_pages']}, verified {r['verified_bytes']} B, deadline exceeded "
                  f"{r['stats']['rpcs_deadline_exceeded']}, sessions lost "
                  f"{r['stats']['sessions_lost']}")

    # Every bystander heartbeat answered within its deadline, and every session stayed active.
    for p in probes:
        assert p.errors == [], p.errors
        assert p.states and all(s == cpb.SESSION_STATE_ACTIVE for s in p.states), p.states
    assert worst < HEARTBEAT_DEADLINE_S, worst
    # The verified traffic: no RPC past its deadline, no session lost, every byte right.
    for t, (out, err), r in zip(traffic, results, traffic_json):
        assert t.returncode == EXIT_OK, (t.returncode, out, err[-3000:])
        s = r["stats"]
        assert s["rpcs_deadline_exceeded"] == 0 and s["rpcs_failed"] == 0, s
        assert s["sessions_lost"] == 0 and s["reregistrations"] == 0, s
        assert s["heartbeats_failed"] == 0, s
        assert r["mismatched_bytes"] == 0 and r["match_errors"] == 0, r
        assert r["loads_not_done"] == 0 and r["backups_not_done"] == 0, r
        assert r["verified_bytes"] > 0 and r["stored_pages"] > 0, r
        assert r["session"]["generation"] == 1, r["session"]
    for t in traffic:
        remove_engine_shm(t.pid)
    assert lapsed == [], lapsed

    # Each drainer got its reply after its drain, with the right counts.
    for name, (dr, reply) in replies.items():
        assert dr.proc.returncode == EXIT_OK, (name, reply, dr.proc.stderr.read())
        assert reply["unregistered"] and reply["error"] == "", reply
        assert reply["pins_released"] == 0, reply
        if name.startswith("stuck"):
            assert reply["ops_cancelled"] == OPS_PER_DRAINER and reply["ops_completed"] == 0, reply
            # The drain is honoured: the reply waits for it (not longer than it, give or take).
            assert DRAIN_MS - 100 <= reply["unregister_ms"] < DRAIN_MS + 2000, reply
        else:
            assert reply["ops_completed"] == OPS_PER_DRAINER and reply["ops_cancelled"] == 0, reply
            # Answered when the ops ended at their ready deadline, before the drain was over.
            assert reply["unregister_ms"] < ENDING_DRAIN_MS - 1000, reply
        # The daemon's own account agrees with the reply.
        ended = [f for f in map(parse_log_line, d.log().splitlines())
                 if f.get("msg") == "session ended" and f.get("instance_id") == name]
        assert len(ended) == 1 and ended[0]["reason"] == "unregistered", ended
        for key in ("ops_completed", "ops_cancelled", "pins_released"):
            assert int(ended[0][key]) == reply[key], (key, ended[0], reply)


def test_a_daemon_shutting_down_cuts_a_drain_short_and_ends_the_session(daemon_factory):
    d = daemon_factory(args=DAEMON_ARGS)
    require_cache_service(d)
    dr = Drainer(d.socket, "closing", 10000, 9000, 300)
    assert dr.line()["pending"] == OPS_PER_DRAINER
    dr.go()
    d.wait_for_line(r"msg=\"?session registered\"?.*instance_id=\"?closing")
    time.sleep(0.5)  # The drain is under way.
    start = time.monotonic()
    assert d.stop() == 0, d.log()
    stopped = time.monotonic() - start
    reply = dr.finish()
    print(f"\nstopped in {stopped * 1000:.0f} ms; {reply}")
    # Answered when the daemon began to drain, not after the 9 s drain, with its ops cancelled.
    assert dr.proc.returncode == EXIT_OK, (reply, dr.proc.stderr.read())
    assert reply["unregistered"] and reply["error"] == "", reply
    assert reply["ops_cancelled"] == OPS_PER_DRAINER and reply["ops_completed"] == 0, reply
    assert reply["unregister_ms"] < 3000, reply
    assert stopped < 3, stopped
    ended = [f for f in map(parse_log_line, d.log().splitlines())
             if f.get("msg") == "session ended" and f.get("instance_id") == "closing"]
    assert len(ended) == 1 and ended[0]["reason"] == "unregistered", ended
