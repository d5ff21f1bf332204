"""Real redis-server processes for the L3 integration tests (Debian's redis-server and
redis-cli), started by the test in its temp directory: a standalone server on a Unix socket, and
a 3-primary Redis Cluster on loopback ports built with CLUSTER ADDSLOTSRANGE and MEET.
"""
import os
import signal
import socket
import subprocess
import time

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"


def free_cluster_port():
    """A loopback port whose cluster bus port (+10000) is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise AssertionError("no free port pair for a cluster node")


class RedisServer:
    def __init__(self, directory, port=0, cluster=False):
        self.dir = str(directory)
        os.makedirs(self.dir, exist_ok=True)
        self.port = port
        self.cluster = cluster
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
                     "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
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

    def dbsize(self):
        return int(self.cli("DBSIZE").strip())

    def keys(self, pattern="*"):
        return [k for k in self.cli("--scan", "--pattern", pattern).split("\n") if k]

    def object_count(self):
        """Keys that hold objects: all but the tier's index hashes (storage/redis_index.h)."""
        return sum(1 for k in self.keys() if ":idx" not in k)


class RedisCluster:
    NODES = 3

    def __init__(self, directory):
        self.nodes = [RedisServer(os.path.join(str(directory), f"node{i}"), free_cluster_port(),
                                  cluster=True) for i in range(self.NODES)]

    @staticmethod
    def first_slot(i):
        return 16384 * i // RedisCluster.NODES

    def start(self):
        for n in self.nodes:
            n.start()
        for i, n in enumerate(self.nodes):
            n.cli("CLUSTER", "SET-CONFIG-EPOCH", str(i + 1))
            n.cli("CLUSTER", "ADDSLOTSRANGE", str(self.first_slot(i)),
                  str(self.first_slot(i + 1) - 1))
        for n in self.nodes[1:]:
            self.nodes[0].cli("CLUSTER", "MEET", "127.0.0.1", str(n.port))
        self.wait_ok()
        return self

    def wait_ok(self, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) and
                   f"cluster_known_nodes:{self.NODES}" in n.cli("CLUSTER", "INFO", check=False)
                   for n in self.nodes):
                return
            time.sleep(0.05)
        raise AssertionError("redis cluster did not converge")

    def node_id(self, i):
        return self.nodes[i].cli("CLUSTER", "MYID").strip()

    def move_slots(self, first, last, to):
        """Gives slots [first, last] to node `to` on every node, without moving keys: a client
        that asks the old owner gets MOVED."""
        target = self.node_id(to)
        script = "".join(f"CLUSTER SETSLOT {s} NODE {target}\n" for s in range(first, last + 1))
        for n in self.nodes:
            n.cli(stdin=script)

    def seeds(self):
        return ",".join(n.address for n in self.nodes)

    def dbsize(self):
        return sum(n.dbsize() for n in self.nodes)

    def object_count(self):
        return sum(n.object_count() for n in self.nodes)

    def stop(self):
        for n in self.nodes:
            n.stop()
