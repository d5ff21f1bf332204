"""Real redis-server processes for the L3 integration tests (Debian's redis-server and
redis-cli), started by the test in its temp directory: a standalone server on a Unix socket, and
a 3-primary Redis Cluster on loopback ports built with CLUSTER ADDSLOTSRANGE and MEET, optionally
with one replica per primary (CLUSTER REPLICATE) that Redis Cluster's own failover promotes when
its primary dies.
"""
import os
import random
import signal
import socket
import subprocess
import time

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(taken=()):
    """A loopback port whose cluster bus port (+10000) is free too, neither of them in `taken`
    (the ports of the cluster's other nodes, which may not have bound them yet). Both lie below
    the kernel's ephemeral range (32768 and up), so that no outgoing connection of a test running
    beside this one takes either before redis-server binds it; another test may still pick the
    same port, and RedisCluster then starts that node on another (PortTaken)."""
    for _ in range(200):
        port = random.randrange(10000, 22768)
        if port in taken or port + 10000 in taken:
            continue
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise AssertionError("no free port pair for a cluster node")


class PortTaken(AssertionError):
    """redis-server exited at start: its port was taken after it was picked."""


class RedisServer:
    def __init__(self, directory, port=0, cluster=False, node_timeout_ms=2000,
                 full_coverage=True):
        self.dir = str(directory)
        os.makedirs(self.dir, exist_ok=True)
        self.port = port
        self.cluster = cluster
        # cluster-node-timeout: how long a node may be unreachable before it is failing; a
        # replica's failover starts about then.
        self.node_timeout_ms = node_timeout_ms
        # cluster-require-full-coverage: `no` keeps the other slots served while some have no
        # live primary.
        self.full_coverage = full_coverage
        self.socket = os.path.join(self.dir, "redis.sock")
        self.proc = None

    @property
    def address(self):
        """As a kvcellar tier spec names it."""
        return f"unix:{self.socket}" if self.port == 0 else f"127.0.0.1:{self.port}"

    def start(self):
        args = [REDIS_SERVER, "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning",
                "--logfile", os.path.join(self.dir, "redis.log")]
        if self.port == 0:
            args += ["--unixsocket", self.socket, "--unixsocketperm", "700"]
        else:
            args += ["--bind", "127.0.0.1", "--protected-mode", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     os.path.join(self.dir, f"nodes-{self.port}.conf"),
                     "--cluster-node-timeout", str(self.node_timeout_ms),
                     "--cluster-require-full-coverage", "yes" if self.full_coverage else "no",
                     # A replica's first sync starts at once, not after the default 5 s wait
                     # for more replicas.
                     "--repl-diskless-sync-delay", "0"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # A port taken meanwhile: its PONG is not ours.
                log = os.path.join(self.dir, "redis.log")
                tail = open(log).read()[-2000:] if os.path.exists(log) else ""
                raise PortTaken(f"redis-server exited ({self.proc.returncode}) in {self.dir}:"
                                f"\n{tail}")
            if self.cli("PING", check=False).strip() == "PONG":
                return self
            time.sleep(0.02)
        raise AssertionError(f"redis-server did not start in {self.dir}")

    def cli(self, *command, check=True, stdin=None):
        where = ["-s", self.socket] if self.port == 0 else ["-h", "127.0.0.1", "-p", str(self.port)]
        p = subprocess.run([REDIS_CLI, *where, *command], capture_output=True, text=True,
                           timeout=30, input=stdin)
        if check and p.returncode != 0:
            raise AssertionError(f"redis-cli {command}: {p.stderr}")
        return p.stdout

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, sig=signal.SIGTERM):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
        self.proc = None

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def role(self):
        """"master" or "slave" (ROLE), "" when the server does not answer."""
        out = self.cli("ROLE", check=False).split("\n")
        return out[0].strip() if out else ""

    def dbsize(self):
        return int(self.cli("DBSIZE").strip())

    def keys(self, pattern="*"):
        return [k for k in self.cli("--scan", "--pattern", pattern).split("\n") if k]

    def object_count(self):
        """Keys that hold objects: all but the tier's index hashes (storage/redis_index.h)."""
        return sum(1 for k in self.keys() if ":idx" not in k)


class RedisCluster:
    """Three primaries with the slots split evenly, each with `replicas` replicas (0 or more).
    `nodes` are the primaries as started; `replicas[i]` replicate nodes[i]."""
    NODES = 3

    def __init__(self, directory, replicas=0, node_timeout_ms=2000):
        # With replicas, the surviving primaries keep serving their slots while a dead one's
        # replica takes over (cluster-require-full-coverage no).
        opts = dict(cluster=True, node_timeout_ms=node_timeout_ms, full_coverage=replicas == 0)
        taken = set()

        def server(name):
            port = free_cluster_port(taken)
            taken.update((port, port + 10000))
            return RedisServer(os.path.join(str(directory), name), port, **opts)

        self.nodes = [server(f"node{i}") for i in range(self.NODES)]
        self.replicas = [[server(f"node{i}-replica{r}") for r in range(replicas)]
                         for i in range(self.NODES)]

    @property
    def all_nodes(self):
        return self.nodes + [r for rs in self.replicas for r in rs]

    @staticmethod
    def first_slot(i):
        return 16384 * i // RedisCluster.NODES

    def start(self):
        """Starts and joins every node; on failure stops those started (no server outlives a
        test whose fixture failed)."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self):
        taken = {p for n in self.all_nodes for p in (n.port, n.port + 10000)}
        for n in self.all_nodes:
            for attempt in range(5):
                try:
                    n.start()
                    break
                except PortTaken:
                    if attempt == 4:
                        raise
                    n.port = free_cluster_port(taken)
                    taken.update((n.port, n.port + 10000))
        for i, n in enumerate(self.nodes):
            n.cli("CLUSTER", "SET-CONFIG-EPOCH", str(i + 1))
            n.cli("CLUSTER", "ADDSLOTSRANGE", str(self.first_slot(i)),
                  str(self.first_slot(i + 1) - 1))
        for n in self.all_nodes[1:]:
            self.nodes[0].cli("CLUSTER", "MEET", "127.0.0.1", str(n.port))
        self.wait_ok()
        if any(self.replicas):
            for i, rs in enumerate(self.replicas):
                for r in rs:
                    r.cli("CLUSTER", "REPLICATE", self.node_id(i))
            self.wait_replicas_synced()
        return self

    def wait_ok(self, timeout=20):
        known = f"cluster_known_nodes:{len(self.all_nodes)}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) and
                   known in n.cli("CLUSTER", "INFO", check=False)
                   for n in self.all_nodes):
                return
            time.sleep(0.05)
        seen = {n.port: [line.strip()
                         for line in n.cli("CLUSTER", "INFO", check=False).splitlines()
                         if line.startswith(("cluster_state", "cluster_known_nodes"))]
                for n in self.all_nodes}
        raise AssertionError(f"redis cluster did not converge: {seen}")

    def wait_replicas_synced(self, timeout=20):
        """Every replica's link to its primary is up and every node lists it as that primary's
        replica: from then on a failover can promote it."""
        deadline = time.monotonic() + timeout
        want = {(r.cli("CLUSTER", "MYID").strip(), self.node_id(i))
                for i, rs in enumerate(self.replicas) for r in rs}
        while time.monotonic() < deadline:
            linked = all("master_link_status:up" in r.cli("INFO", "replication", check=False)
                         for rs in self.replicas for r in rs)
            if linked and all(want <= self._replica_pairs(n) for n in self.all_nodes):
                return
            time.sleep(0.05)
        raise AssertionError("redis cluster replicas did not sync")

    @staticmethod
    def _cluster_nodes(node):
        """CLUSTER NODES of `node` as [(id, flags, primary id, slot ranges)]."""
        rows = []
        for line in node.cli("CLUSTER", "NODES", check=False).splitlines():
            f = line.split()
            if len(f) >= 8:
                rows.append((f[0], f[2].split(","), f[3], f[8:]))
        return rows

    def _replica_pairs(self, node):
        return {(nid, primary) for nid, flags, primary, _ in self._cluster_nodes(node)
                if "slave" in flags}

    def node_id(self, i):
        return self.nodes[i].cli("CLUSTER", "MYID").strip()

    def kill_primary(self, i):
        """SIGKILLs primary i (no persistence: its data lives on only in its replicas)."""
        self.nodes[i].stop(signal.SIGKILL)

    def failover_done(self, i):
        """Whether a replica of dead primary i is now a primary, and every live node says it
        owns i's slots."""
        promoted = [r for r in self.replicas[i] if r.alive() and r.role() == "master"]
        if not promoted:
            return False
        new_id = promoted[0].cli("CLUSTER", "MYID").strip()
        slots = f"{self.first_slot(i)}-{self.first_slot(i + 1) - 1}"
        for n in self.all_nodes:
            if not n.alive():
                continue
            owners = [nid for nid, flags, _, ranges in self._cluster_nodes(n)
                      if "master" in flags and slots in ranges]
            if owners != [new_id]:
                return False
        return True

    def wait_failover(self, i, timeout=30):
        """Waits for failover_done(i); returns the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.failover_done(i):
                return time.monotonic() - t0
            time.sleep(0.05)
        raise AssertionError(f"no replica of redis primary {i} took over in {timeout}s")

    def move_slots(self, first, last, to):
        """Gives slots [first, last] to node `to` on every node, without moving keys: a client
        that asks the old owner gets MOVED."""
        target = self.node_id(to)
        script = "".join(f"CLUSTER SETSLOT {s} NODE {target}\n" for s in range(first, last + 1))
        for n in self.nodes:
            n.cli(stdin=script)

    def seeds(self):
        """The primaries as started (a client learns replicas and later primaries from them)."""
        return ",".join(n.address for n in self.nodes)

    def dbsize(self):
        return sum(n.dbsize() for n in self.nodes)

    def object_count(self):
        return sum(n.object_count() for n in self.nodes)

    def stop(self):
        for n in self.all_nodes:
            n.stop()
