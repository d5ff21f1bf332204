"""An engine reaches only its own memory (issue #24): real engine processes under two other uids
try every way of naming memory that is not theirs, against a daemon running as root and one
running as an unprivileged user, with and without tenants.allow.

The victim (uid B) holds a KV object, a signal region, a read-only-shared object and a memfd
host pool (foreign_memory.py victim). The attacker (uid A) registers engines whose regions or
signal region name: the daemon's L2 pool and journal (pool.shm_name), the victim's POSIX shm
object, the victim's memfd as /proc/<victim pid>/fd/<fd>, its own /proc fd of the victim's
object, the victim's signal region, a symlink and a hard link to the victim's object, a hard link
to the pool, and its own object swapped for the victim's under the same name while it registers.
An engine running as the daemon's own user names the pool and journal too. Every attempt must be
PERMISSION_DENIED / ERROR_REASON_MEMORY_NOT_OWNED naming the field; the victim's bytes must be
unchanged and the daemon must never have mapped them (its /proc/<pid>/maps); and both users'
engines are served as before, every byte verified. Over TCP, where no uid is known, host memory
is refused unless listen.tcp_host_memory.
Interpreter: Debian's /usr/bin/python3 (python3-grpcio, python3-pytest). Needs root (CI runs as
root) to start processes under other uids.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from conftest import PY_DIR
from engine_sim import DAEMON_ARGS, EXIT_OK, EngineResult, admin, engine_args
from kvcellard_process import Daemon

from kvcellar.v1 import admin_service_pb2 as apb

# Uids no account of the machine uses: engines of team-a and team-b, and the daemon's own user.
UID_A, UID_B, UID_DAEMON = 41001, 41002, 41003
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "foreign_memory.py")
GEOMETRY = dict(layers=2, block_bytes=4096, blocks=16, page_size=16, model="tenant-mem")
PAGE_BYTES = 2 * 2 * 4096

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starts processes under other uids")


def as_user(uid):
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def child_env():
    return dict(os.environ, KVCELLAR_PY_DIR=os.path.abspath(PY_DIR), PYTHONDONTWRITEBYTECODE="1")


class Node:
    """A daemon (as root or UID_DAEMON) on a directory every test uid can reach."""

    def __init__(self, daemon_uid, grants, extra=()):
        self.uid = daemon_uid
        self.dir = tempfile.mkdtemp(prefix="kvc-tenant-mem-")
        os.chmod(self.dir, 0o755)
        os.chown(self.dir, daemon_uid, daemon_uid)
        self.pool = f"/kvc-tm-{os.getpid()}-{os.path.basename(self.dir)}-pool"
        args = [*DAEMON_ARGS, "--set", "listen.unix_socket_mode=0666",
                "--set", f"pool.shm_name={self.pool}", *extra]
        if grants:
            args += ["--set", f"tenants.allow=team-a=uid:{UID_A};team-b=uid:{UID_B};"
                              f"=uid:{daemon_uid}"]
        self.daemon = Daemon(pathlib.Path(self.dir), args=args)
        if daemon_uid != 0:
            self.daemon.args = [*as_user(daemon_uid), *self.daemon.args]
        self.daemon.start()
        self.tenant_a = "team-a" if grants else ""
        self.tenant_b = "team-b" if grants else ""
        # An unprivileged daemon opens only what engines share with it: engines that want to be
        # served say so with their objects' mode (0666 here; 0660 with a common group in real life).
        self.engine_mode = 0o600 if daemon_uid == 0 else 0o666

    @property
    def socket(self):
        return self.daemon.socket

    def maps(self):
        with open(f"/proc/{self.daemon.proc.pid}/maps") as f:
            return f.read().splitlines()

    def mapped_files(self):
        """Every file the daemon maps, as "major:minor inode"."""
        return {" ".join(line.split()[3:5]) for line in self.maps() if len(line.split()) >= 5}

    def close(self):
        self.daemon.stop()
        for name in (self.pool, self.pool + ".journal"):
            try:
                os.unlink("/dev/shm" + name)
            except FileNotFoundError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


class Victim:
    def __init__(self, uid, prefix, mode):
        self.proc = subprocess.Popen([*as_user(uid), sys.executable, SCRIPT, "victim", prefix,
                                      oct(mode)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=child_env())
        line = self.proc.stdout.readline()
        assert line, "victim printed nothing"
        self.info = json.loads(line)

    def digests(self):
        self.proc.stdin.write("digest\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def attack(uid, target, plan):
    res = subprocess.run([*as_user(uid), sys.executable, SCRIPT, "attack", target,
                          json.dumps(plan)], capture_output=True, text=True, timeout=120,
                         env=child_env())
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def assert_refused(results, expected_fields, os_refuses=()):
    """Every attempt PERMISSION_DENIED naming its field: refused by the daemon's ownership check
    (MEMORY_NOT_OWNED), or, for the attempts in `os_refuses`, by the kernel before that check
    could run (HANDLE_OPEN_FAILED: an unprivileged daemon may not reopen another user's fd)."""
    assert [r["name"] for r in results] == list(expected_fields), results
    for r in results:
        assert r["code"] == "PERMISSION_DENIED", r
        reasons = {"ERROR_REASON_MEMORY_NOT_OWNED"}
        if r["name"] in os_refuses:
            reasons.add("ERROR_REASON_HANDLE_OPEN_FAILED")
        assert r["reason"] in reasons, r
        assert r["field"] == expected_fields[r["name"]], r
        assert r["details"].startswith(r["field"]), r


def served(node, uid, tenant, seed):
    """A backup and a verified load by an engine process of `uid`: the user is served."""
    flags = dict(instance=f"served-{uid}-{seed}", rank=0, tp=1, tokens_seed=seed, pages=4,
                 tenant=tenant, shm_mode=format(node.engine_mode, "04o"), **GEOMETRY)
    runs = []
    for command, extra in (("backup", dict(seed=seed)),
                           ("load", dict(verify_seed=seed, first_block=8))):
        cmd = [*as_user(uid), *engine_args(node.socket, command, **flags, **extra)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        runs.append(EngineResult(cmd, p.returncode, p.stdout, p.stderr))
    backup, load = runs
    assert backup.rc == EXIT_OK and backup["stored"] == 4, backup.describe()
    assert load.rc == EXIT_OK and load["loaded"] == 4, load.describe()
    assert load["mismatched_bytes"] == 0 and load["verified_bytes"] == 4 * PAGE_BYTES


class Swapper:
    """Flips the name `path` between two objects (hard links `first` and `second`) as fast as it
    can: an object replaced between the engine's naming and the daemon's open."""

    def __init__(self, path, first, second):
        self.path, self.sources, self.stop_flag = path, (first, second), False
        self.flips = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        tmp = self.path + ".swap"
        while not self.stop_flag:
            src = self.sources[self.flips % 2]
            os.link(src, tmp)
            os.rename(tmp, self.path)
            self.flips += 1

    def stop(self):
        self.stop_flag = True
        self.thread.join()


@pytest.mark.parametrize("daemon_uid", [0, UID_DAEMON], ids=["daemon-root", "daemon-unprivileged"])
@pytest.mark.parametrize("grants", [True, False], ids=["tenants-allow", "default-config"])
def test_an_engine_maps_only_its_own_memory(daemon_uid, grants):
    node = Node(daemon_uid, grants)
    tag = f"/kvc-tm-{os.getpid()}-{daemon_uid}-{int(grants)}"
    victim = Victim(UID_B, f"{tag}-victim", node.engine_mode)
    links = []
    try:
        before = victim.digests()
        names, v = victim.info["names"], victim.info
        # Links the attacker could not make itself (protected_hardlinks), made for it: what a
        # laxer node, or an object the victim made linkable, would allow.
        def link(kind, target):
            name = f"{tag}-{kind}"
            if kind == "symlink":
                os.symlink("/dev/shm" + target, "/dev/shm" + name)
            else:
                os.link("/dev/shm" + target, "/dev/shm" + name)
            links.append("/dev/shm" + name)
            return name
        sym, hard, hard_pool = (link("symlink", names["kv"]), link("hardlink", names["kv"]),
                                link("hardlink-pool", node.pool))
        pool_maps_before = sum(1 for line in node.maps() if node.pool in line)

        region = "layout.regions[0]"
        plan = {"tenant": node.tenant_a, "own_mode": 0o666,
                "open_readonly": ["/dev/shm" + names["ro"]],
                "attempts": [
                    {"name": "daemon-pool", "region": node.pool},
                    {"name": "daemon-journal", "region": node.pool + ".journal"},
                    {"name": "victim-shm", "region": names["kv"]},
                    {"name": "victim-memfd", "region": f"/proc/{v['pid']}/fd/{v['memfd']}"},
                    {"name": "own-fd-of-victim-object", "region": "self-fd:/dev/shm" + names["ro"]},
                    {"name": "victim-signal-region", "region": "own", "signals": names["sig"]},
                    {"name": "symlink", "region": sym},
                    {"name": "hard-link", "region": hard},
                    {"name": "hard-link-to-pool", "region": hard_pool},
                    # Process memory (/proc/<pid>/mem, copied with process_vm_readv/writev):
                    # the victim's plain memory, and the daemon's own, which holds the pool.
                    {"name": "victim-process-memory", "region": f"/proc/{v['pid']}/mem",
                     "offset": v["private_address"]},
                    {"name": "daemon-process-memory",
                     "region": f"/proc/{node.daemon.proc.pid}/mem", "offset": 1 << 20},
                ]}
        assert_refused(attack(UID_A, node.socket, plan), {
            "daemon-pool": region, "daemon-journal": region, "victim-shm": region,
            "victim-memfd": region, "own-fd-of-victim-object": region,
            "victim-signal-region": "completion.sim_counters.shm_name", "symlink": region,
            "hard-link": region, "hard-link-to-pool": region, "victim-process-memory": region,
            "daemon-process-memory": region},
            # /proc/<pid>/fd of another user is a ptrace-mode open: a daemon that is neither
            # root nor the engine's user is refused by the kernel itself.
            os_refuses=() if daemon_uid == 0 else ("own-fd-of-victim-object",))

        # An engine of the daemon's own user owns the pool's object: still not its memory.
        same_user = {"tenant": "", "own_mode": 0o600, "attempts": [
            {"name": "daemon-pool", "region": node.pool},
            {"name": "daemon-journal", "region": node.pool + ".journal"},
            {"name": "hard-link-to-pool", "region": hard_pool},
            {"name": "daemon-process-memory", "region": f"/proc/{node.daemon.proc.pid}/mem",
             "offset": 1 << 20}]}
        assert_refused(attack(daemon_uid, node.socket, same_user),
                       {"daemon-pool": region, "daemon-journal": region,
                        "hard-link-to-pool": region, "daemon-process-memory": region})
        # An engine's own plain memory is served where the kernel lets the daemon reach it:
        # by a root daemon; an unprivileged one may not ptrace another user's process.
        own = attack(UID_A, node.socket, {"tenant": node.tenant_a,
                                          "attempts": [{"name": "own-process-memory",
                                                        "region": "self-mem"}]})[0]
        if daemon_uid == 0:
            assert own["code"] == "OK", own
        else:
            assert own["code"] == "FAILED_PRECONDITION", own
            assert own["reason"] == "ERROR_REASON_HANDLE_OPEN_FAILED", own
            assert "CAP_SYS_PTRACE" in own["details"], own

        # The attacker's own object, replaced by the victim's under the same name again and
        # again while it registers: whatever the daemon opens is judged as opened.
        swap = f"{tag}-swap"
        own_keep = f"/dev/shm{tag}-swap-own"
        fd = os.open(own_keep, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        os.ftruncate(fd, 2 * 2 * 16 * 4096)
        os.fchmod(fd, node.engine_mode)
        os.fchown(fd, UID_A, UID_A)
        os.close(fd)
        links += [own_keep, "/dev/shm" + swap]
        swapper = Swapper("/dev/shm" + swap, own_keep, "/dev/shm" + names["kv"])
        try:
            results = attack(UID_A, node.socket, {"tenant": node.tenant_a, "attempts": [
                {"name": f"swap-{i}", "region": swap} for i in range(40)]})
        finally:
            swapper.stop()
        outcomes = {}
        for r in results:
            assert r["code"] in ("OK", "PERMISSION_DENIED"), r
            if r["code"] == "PERMISSION_DENIED":
                assert r["reason"] == "ERROR_REASON_MEMORY_NOT_OWNED" and r["field"] == region, r
            outcomes[r["code"]] = outcomes.get(r["code"], 0) + 1
        print(f"swap race: {outcomes} over {swapper.flips} flips")
        assert swapper.flips > 40

        # Nothing of the victim's was written, or ever mapped by the daemon.
        assert victim.digests() == before
        assert not set(v["files"].values()) & node.mapped_files(), node.maps()
        assert sum(1 for line in node.maps() if node.pool in line) == pool_maps_before
        sessions = admin(node.daemon).ListEngines(apb.ListEnginesRequest(), timeout=5).sessions
        assert not [s for s in sessions if s.instance_id.startswith("attacker-")], sessions

        # Both users' engines are served, every byte verified.
        served(node, UID_A, node.tenant_a, seed=7)
        served(node, UID_B, node.tenant_b, seed=8)
        assert victim.digests() == before
    finally:
        victim.close()
        for path in links:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        node.close()


@pytest.mark.parametrize("trusted", [False, True], ids=["default", "tcp_host_memory"])
def test_host_memory_over_tcp_has_no_owner_to_check(trusted):
    extra = ["--set", "listen.tcp_address=127.0.0.1:0"]
    if trusted:
        extra += ["--set", "listen.tcp_host_memory=true"]
    node = Node(0, grants=False, extra=extra)
    try:
        tcp = node.daemon.ready["tcp"]
        results = attack(UID_A, tcp, {"attempts": [{"name": "own", "region": "own"},
                                                   {"name": "daemon-pool", "region": node.pool},
                                                   {"name": "own-process-memory",
                                                    "region": "self-mem"}]})
        own, pool, process = results
        # A TCP peer has no pid: its process memory is refused even on a trusting node.
        assert process["code"] == "PERMISSION_DENIED", process
        assert process["reason"] == "ERROR_REASON_MEMORY_NOT_OWNED", process
        if trusted:
            assert own["code"] == "OK", own
        else:
            assert own["code"] == "PERMISSION_DENIED", own
            assert own["reason"] == "ERROR_REASON_MEMORY_NOT_OWNED", own
            assert own["field"] == "layout.regions[0]", own
            assert "Unix socket" in own["details"], own
        # Whoever is trusted, the pool is nobody's.
        assert pool["code"] == "PERMISSION_DENIED", pool
        assert pool["reason"] == "ERROR_REASON_MEMORY_NOT_OWNED", pool
    finally:
        node.close()
