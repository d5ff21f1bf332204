"""The deployment files under deploy/: Kubernetes manifests, the seccomp profile, Prometheus
configuration and rules, the Grafana dashboard.

Beyond syntax, each file is checked against what it describes: the ConfigMap's kvcellard.yaml
passes --check-config and starts a real daemon; kvcellard runs, serves and drains under the
seccomp profile (loaded with libseccomp); promtool checks the Prometheus files and unit-tests the
alerts; every metric the rules and the dashboard use is exported by a running daemon; and a real
Prometheus scrapes a real daemon, evaluates every rule and every dashboard query, and sees the
daemon go down.

Interpreter: Debian's /usr/bin/python3 (python3-yaml), Debian's prometheus and promtool.
"""
import ctypes
import ctypes.util
import glob
import json
import os
import platform
import re
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from conftest import BIN_DIR, KVCELLARCTL, KVCELLARD, SOURCE_DIR, Daemon, run
from engine_sim import run_engine, wait_until
from kvcellard_process import end_process
from redis_util import REDIS_SERVER, RedisServer

DEPLOY = os.path.join(SOURCE_DIR, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
SECCOMP = os.path.join(K8S, "seccomp", "kvcellard.json")
PROM_CONFIG = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
ALERTS = os.path.join(DEPLOY, "prometheus", "alerts.yml")
ALERTS_TEST = os.path.join(DEPLOY, "prometheus", "alerts_test.yml")
DASHBOARD = os.path.join(DEPLOY, "grafana", "kvcellar-dashboard.json")
METRICS_DOC = os.path.join(SOURCE_DIR, "docs", "metrics.md")
ENGINE_SIM = os.path.join(BIN_DIR, "kvcellar-engine-sim")

# The job name the rules and the dashboard select on: prometheus.yml's job and the
# ServiceMonitor's jobLabel must produce it.
JOB = "kvcellard"

# The group engines join to reach the engine socket (mode 0660). The ConfigMap leaves
# listen.unix_socket_group empty, so the socket gets the daemon's group: kvcellard resolves a
# configured group through /etc/group, where a Kubernetes fsGroup has no entry.
SOCKET_GID = 2000

# Series the rules or dashboard may use that kvcellard does not export, and where they come from.
EXTERNAL_METRICS = {
    "up": "recorded by Prometheus for every scrape",
    "kube_pod_container_status_ready": "kube-state-metrics (the KvcellarNotReady alert)",
}

NAMESPACED_KINDS = {"ConfigMap", "DaemonSet", "Deployment", "Service", "ServiceMonitor"}
CLUSTER_KINDS = {"Namespace", "PriorityClass"}


# ---- Helpers ---------------------------------------------------------------------------------

def yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def k8s_objects():
    objs = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        for doc in yaml_docs(path):
            objs.append((os.path.basename(path), doc))
    return objs


def k8s_object(kind, name=None):
    found = [o for _, o in k8s_objects() if o.get("kind") == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def containers(spec):
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def container(spec, name):
    found = [c for c in containers(spec) if c["name"] == name]
    assert len(found) == 1, f"no single container {name!r}"
    return found[0]


def config_map():
    return k8s_object("ConfigMap", "kvcellard-config")


def embedded_config_text():
    return config_map()["data"]["kvcellard.yaml"]


def embedded_config():
    return yaml.safe_load(embedded_config_text())


_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def kvcellar_size(text):
    """A kvcellard size ("64GiB", "4GB", "1048576")."""
    m = re.fullmatch(r"(\d+)\s*([KMGT]i?B|B)?", str(text).strip())
    assert m, f"not a kvcellard size: {text!r}"
    return int(m.group(1)) * _UNITS[m.group(2) or ""]


_QUANTITY = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def k8s_quantity(text):
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert m, f"not a Kubernetes memory quantity: {text!r}"
    return int(m.group(1)) * _QUANTITY[m.group(2) or ""]


def set_overrides(args):
    """{key: value} of the --set key=value pairs in a container's args."""
    out = {}
    for flag, value in zip(args, args[1:]):
        if flag == "--set":
            key, _, v = value.partition("=")
            out[key] = v
    return out


def pool_capacity(c):
    """The pool.capacity a kvcellard container runs with: its --set, else the ConfigMap's."""
    sets = set_overrides(c.get("args", []))
    return kvcellar_size(sets.get("pool.capacity", embedded_config()["pool"]["capacity"]))


def http_port():
    address = embedded_config()["http"]["address"]
    return int(address.rsplit(":", 1)[1])


def probe_port(c, probe):
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert named, f"probe port {port!r} is not a port of container {c['name']}"
    return named[0]


def check_probes(c):
    """Readiness on /readyz, liveness on /healthz, over HTTP on kvcellard's http.address port."""
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        if kind in c:
            assert probe_port(c, c[kind]) == http_port(), (kind, c["name"])
            assert "grpc" not in c[kind], "native gRPC probes need a TCP gRPC port"


def check_memory_fits_pool(c):
    limits = c["resources"]["limits"]
    requests = c["resources"]["requests"]
    limit = k8s_quantity(limits["memory"])
    pool = pool_capacity(c)
    # Every pool page is charged to the container: the limit is the pool plus the daemon itself.
    assert limit >= pool + (1 << 30), f"{c['name']}: memory limit {limits['memory']} < pool {pool} + 1 GiB"
    assert requests["memory"] == limits["memory"], "requests = limits: Guaranteed QoS"


def check_hardened(c, spec):
    sc = dict(spec.get("securityContext", {}))
    sc.update(c.get("securityContext", {}))
    assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("readOnlyRootFilesystem") is True
    assert sc.get("capabilities", {}).get("drop") == ["ALL"]
    assert not sc.get("privileged", False)


def check_gpu_visibility(c, spec):
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    assert "compute" in env.get("NVIDIA_DRIVER_CAPABILITIES", "").split(",")
    assert spec.get("runtimeClassName"), "the NVIDIA runtime injects the driver"
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in c["resources"].get(section, {}), "sees GPUs, claims none"


def mount_of(c, path):
    found = [m for m in c.get("volumeMounts", []) if m["mountPath"] == path]
    assert found, f"container {c['name']} mounts nothing at {path}"
    return found[0]


def volume(spec, name):
    found = [v for v in spec.get("volumes", []) if v["name"] == name]
    assert len(found) == 1, f"no volume {name!r}"
    return found[0]


def socket_dir():
    return os.path.dirname(embedded_config()["listen"]["unix_socket"])


def http_get(url, timeout=5):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# PromQL words that are not metric names.
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                 "or", "unless", "offset", "inf", "nan", "start", "end"}


def promql_metric_names(expr):
    """Metric names a PromQL expression selects: identifiers that are not functions, keywords,
    label names (inside {...} or by/without/on/ignoring lists), durations or strings."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    e = re.sub(r"\{[^{}]*\}", " ", e)
    e = re.sub(r"\[[^\[\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.:])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        if m.group(2) or m.group(1) in _PROMQL_WORDS:
            continue
        names.add(m.group(1))
    return names


def test_promql_metric_names_helper():
    expr = ('histogram_quantile(0.99, sum by (le, method) (rate(kvcellar_rpc_duration_seconds_bucket'
            '{job=~"$job", code!="OK"}[$__rate_interval]))) / on(instance) group_left '
            'max without (x) (up offset 5m) > 1e-3 and bool vector(0)')
    assert promql_metric_names(expr) == {"kvcellar_rpc_duration_seconds_bucket", "up"}


def alert_rules():
    return [r for g in yaml_docs(ALERTS)[0]["groups"] for r in g["rules"]]


def dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def all_panels(dash):
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def label_values_selector(query):
    """The series selector of a Grafana label_values(selector, label) variable query."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
    assert m, f"variable query is not label_values(selector, label): {query!r}"
    return m.group(1), m.group(2)


def dashboard_exprs(dash):
    """(where, expr) for every PromQL expression in the dashboard: panel targets, annotations,
    and the selectors of the variables' label_values queries."""
    out = []
    for p in all_panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"]))
    for a in dash.get("annotations", {}).get("list", []):
        if "expr" in a:
            out.append((f"annotation {a['name']!r}", a["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", label_values_selector(v["query"]["query"])[0]))
    return out


def rule_exprs():
    return [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


def grafana_to_promql(expr, rate_interval="1m"):
    """A dashboard expression as Prometheus would receive it with every daemon selected."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$job", JOB)
            .replace("$instance", ".+"))


def engine_sim(sock, *args):
    assert os.path.exists(ENGINE_SIM), f"{ENGINE_SIM} missing: build the kvcellar-engine-sim target"
    res = run([ENGINE_SIM, "--addr", sock, *args], timeout=60)
    assert res.returncode == 0, f"engine-sim {args} -> {res.returncode}\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def drive_traffic(daemon):
    """Engine traffic on the sim device, so that every family has series: a Backup carves a pool
    size class (kvcellar_pool_*{slot_bytes}), Match/Load count hits and moved bytes, and
    kvcellarctl adds AdminService RPCs."""
    stored = engine_sim(daemon.socket, "backup", "--seed", "1", "--tokens-seed", "7", "--pages", "4")
    assert stored["stored"] == 4, stored
    loaded = engine_sim(daemon.socket, "load", "--tokens-seed", "7", "--pages", "4",
                        "--verify-seed", "1", "--expect-hits", "4")
    assert loaded["hits"] == 4 and loaded["mismatched_bytes"] == 0, loaded
    run([KVCELLARCTL, "--addr", daemon.socket, "status"], check=True, timeout=30)


# L3 traffic: 2 layers x (K + V) x 4 KiB = 16 KiB page objects, O_DIRECT-sized.
L3_GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="metrics-model")
L3_PAGES = 6


@pytest.fixture
def redis_server(tmp_path):
    """A Redis server on a Unix socket for an L3 tier, or None where redis-server is missing."""
    if not os.path.exists(REDIS_SERVER):
        yield None
        return
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def l3_tiers_spec(tmp_path, redis):
    tiers = f"file:{tmp_path / 'l3'}?name=nvme&shared=true"
    if redis is not None:
        tiers += f";redis:{redis.address}?name=redis&prefix=metrics:"
    return tiers


def drive_l3_traffic(daemon_factory, tmp_path, redis, *reader_args):
    """Two daemons sharing L3 tiers (a file tier "nvme", and a Redis tier "redis" when Redis is
    installed). The writer's Backup lands in L2 and every tier (write_through); the reader, whose
    L2 is empty, finds the pages by asking the tiers, prefetches them (wait_complete), loads and
    verifies them, then makes L2 traffic of its own (drive_traffic: a Backup, written through to
    its tiers too). Returns the reader, whose every family then has series: L3 hits per tier,
    bytes and transfer durations in every direction, prefetch outcomes, namespaces."""
    tiers = l3_tiers_spec(tmp_path, redis)
    common = ("--set", "device.kind=sim", "--set", f"storage.tiers={tiers}")
    writer = daemon_factory(args=common, name="writer", subdir="writer")
    # The reader publishes KV events and keeps its pages' tokens in a label log
    # (events.label_log), so that their metrics are exported too.
    reader = daemon_factory(args=(*common, "--set",
                                  f"listen.max_connections_per_uid={READER_CONNECTIONS_PER_UID}",
                                  "--set", f"events.endpoint=ipc://{tmp_path}/reader-events",
                                  "--set", f"events.label_log={tmp_path}/reader.labels",
                                  *reader_args), name="reader", subdir="reader")
    r = run_engine(writer.socket, "backup", instance="writer", seed=31, tokens_seed=9,
                   pages=L3_PAGES, **L3_GEOMETRY)
    assert r.rc == 0 and r["stored"] == L3_PAGES, r.describe()
    wait_until(lambda: metric_value(writer, "kvcellar_l3_writes_total", tier="nvme",
                                    result="ok") >= L3_PAGES, timeout=20, what="L3 writes")
    r = run_engine(reader.socket, "load", instance="reader", verify_seed=31, tokens_seed=9,
                   pages=L3_PAGES, first_block=0, l3_lookup_ms=1000, prefetch="wait_complete",
                   pin=True, **L3_GEOMETRY)
    assert r.rc == 0 and r["mismatched_bytes"] == 0, r.describe()
    assert r["l3_hits"] == L3_PAGES and r["loaded"] == L3_PAGES, r.describe()
    drive_traffic(reader)
    refuse_a_connection(reader)
    return reader


# The reader's per-uid connection bound: room for the engines and tools it serves one at a time,
# low enough that refuse_a_connection reaches it.
READER_CONNECTIONS_PER_UID = 8


def refuse_a_connection(daemon):
    """Holds the user's every engine-socket connection and opens one more, which the daemon
    refuses (kvcellar_unix_connections_refused_total gets its series): it answers with the HTTP/2
    preface and closes within a second."""
    held = []
    try:
        for _ in range(READER_CONNECTIONS_PER_UID):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(daemon.socket)
            held.append(s)
        time.sleep(0.2)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
            extra.settimeout(5)
            extra.connect(daemon.socket)
            while extra.recv(4096):
                pass  # Until the daemon closes it: refused.
    finally:
        for s in held:
            s.close()


def metric_value(daemon, name, **labels):
    """The sum of a family's samples whose labels include `labels`, from /metrics."""
    status, text = http_get(f"http://{daemon.http}/metrics")
    assert status == 200
    total = 0.0
    for family, sample_labels, value in parse_samples(text):
        if family == name and all(sample_labels.get(k) == v for k, v in labels.items()):
            total += value
    return total


def parse_samples(metrics_text):
    """(name, {label: value}, value) for each sample line of a text exposition."""
    out = []
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        assert m, f"unparsed sample line: {line!r}"
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def exported_families(metrics_text):
    """{family name: type} from the # TYPE lines."""
    return {line.split()[2]: line.split()[3] for line in metrics_text.splitlines()
            if line.startswith("# TYPE ")}


def metrics_catalogue():
    """{name: (type, {label: allowed values or None})} from the tables of docs/metrics.md: rows
    whose first cell is a backticked metric name. A label written `label`=a\\|b\\|c lists its
    values; any other backticked label name in the Labels cell allows any value."""
    out = {}
    with open(METRICS_DOC) as f:
        for line in f:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if len(cells) < 4:
                continue
            m = re.fullmatch(r"`((?:kvcellar|process)_\w+)`", cells[0])
            if not m:
                continue
            assert m.group(1) not in out, f"{m.group(1)} listed twice in docs/metrics.md"
            labels = {}
            for lm in re.finditer(r"`([a-z_]+)`(=([\w\-]+(?:\\\|[\w\-]+)+))?", cells[2]):
                if lm.group(1).startswith(("kvcellar_", "process_")):
                    continue
                labels[lm.group(1)] = set(lm.group(3).split("\\|")) if lm.group(3) else None
            out[m.group(1)] = (cells[1], labels)
    return out


def exported_names(metrics_text):
    """Sample names and family names (# TYPE) of a Prometheus text exposition."""
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][\w:]*", line).group(0))
    return names


def daemon_status(daemon):
    res = run([KVCELLARCTL, "--addr", daemon.socket, "--json", "status"], check=True, timeout=30)
    return json.loads(res.stdout)


# ---- Syntax ----------------------------------------------------------------------------------

EXPECTED_FILES = [
    "k8s/configmap.yaml", "k8s/daemonset.yaml", "k8s/sidecar.yaml", "k8s/service-metrics.yaml",
    "k8s/servicemonitor.yaml", "k8s/seccomp/kvcellard.json", "prometheus/prometheus.yml",
    "prometheus/alerts.yml", "prometheus/alerts_test.yml", "grafana/kvcellar-dashboard.json",
    "README.md",
]


def test_every_yaml_and_json_under_deploy_parses():
    for name in EXPECTED_FILES:
        assert os.path.isfile(os.path.join(DEPLOY, name)), name
    checked = 0
    for root, _, files in os.walk(DEPLOY):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith((".yaml", ".yml")):
                yaml_docs(path)
                checked += 1
            elif name.endswith(".json"):
                with open(path) as f:
                    json.load(f)
                checked += 1
    assert checked >= 9


def test_kubernetes_objects_are_well_formed():
    objs = k8s_objects()
    seen = set()
    config_maps = {o["metadata"]["name"] for _, o in objs if o["kind"] == "ConfigMap"}
    namespaces = {o["metadata"]["name"] for _, o in objs if o["kind"] == "Namespace"}
    for path, o in objs:
        assert o.get("apiVersion") and o.get("kind") and o.get("metadata", {}).get("name"), path
        kind = o["kind"]
        assert kind in NAMESPACED_KINDS | CLUSTER_KINDS, f"{path}: unexpected kind {kind}"
        if kind in NAMESPACED_KINDS:
            assert o["metadata"].get("namespace") in namespaces, f"{path}: {kind} outside the namespace"
        key = (kind, o["metadata"].get("namespace"), o["metadata"]["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        if kind not in ("DaemonSet", "Deployment"):
            continue
        template_labels = o["spec"]["template"]["metadata"]["labels"]
        for k, v in o["spec"]["selector"]["matchLabels"].items():
            assert template_labels.get(k) == v, f"{path}: selector {k}={v} misses the template"
        spec = pod_spec(o)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        port_names = []
        names = [c["name"] for c in containers(spec)]
        assert len(names) == len(set(names))
        for c in containers(spec):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{path}: {c['name']} mounts undefined {m['name']}"
            for p in c.get("ports", []):
                if "name" in p:
                    assert len(p["name"]) <= 15, p["name"]
                    port_names.append(p["name"])
            assert c.get("image"), f"{path}: {c['name']} has no image"
            assert "memory" in c.get("resources", {}).get("limits", {}), f"{c['name']}: no memory limit"
        assert len(port_names) == len(set(port_names)), "port names must be unique in a pod"
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps, f"{path}: ConfigMap {v['configMap']['name']}"
        kvcellard = container(spec, "kvcellard")
        assert kvcellard["args"][:2] == ["--config", "/etc/kvcellar/kvcellard.yaml"]
        config_mount = mount_of(kvcellard, "/etc/kvcellar")
        assert volumes[config_mount["name"]]["configMap"]["name"] == "kvcellard-config"


def test_daemonset_node_layout():
    ds = k8s_object("DaemonSet", "kvcellard")
    spec = pod_spec(ds)
    c = container(spec, "kvcellard")
    # CUDA IPC with engines in other pods: one IPC namespace and one PID namespace.
    assert spec["hostIPC"] is True
    assert spec["hostPID"] is True
    assert spec.get("hostNetwork", False) is False
    # The engine socket on the node's /run/kvcellar, where engine pods mount it too.
    assert socket_dir() == "/run/kvcellar"
    sock_volume = volume(spec, mount_of(c, socket_dir())["name"])
    assert sock_volume["hostPath"]["path"] == "/run/kvcellar"
    # The seccomp profile that allows io_uring, by the path the kubelet resolves.
    sc = spec["securityContext"]["seccompProfile"]
    assert sc["type"] == "Localhost"
    assert sc["localhostProfile"].endswith("/" + os.path.basename(SECCOMP))
    assert "seccompProfile" not in c.get("securityContext", {}), "the pod's profile applies"
    check_probes(c)
    check_memory_fits_pool(c)
    check_hardened(c, spec)
    check_gpu_visibility(c, spec)
    # The sockets' group is the daemon's group, the one engine pods join.
    assert spec["securityContext"]["runAsGroup"] == SOCKET_GID
    priority = k8s_object("PriorityClass", spec["priorityClassName"])
    assert priority["value"] > 0
    # SIGKILL only after the drain.
    assert spec["terminationGracePeriodSeconds"] * 1000 > embedded_config()["server"]["drain_timeout_ms"]


def test_sidecar_shares_socket_and_shm_with_the_engine():
    dep = k8s_object("Deployment")
    spec = pod_spec(dep)
    daemon = container(spec, "kvcellard")
    engines = [c for c in containers(spec) if c["name"] != "kvcellard"]
    assert len(engines) == 1
    engine = engines[0]
    assert engine in spec["containers"]
    # The socket directory: one emptyDir mounted by both containers at the socket's directory.
    sock = mount_of(daemon, socket_dir())
    assert mount_of(engine, socket_dir())["name"] == sock["name"]
    assert "emptyDir" in volume(spec, sock["name"])
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    assert env.get("RUNTIME_DIRECTORY") == socket_dir(), "the client's default socket directory"
    # /dev/shm: one memory-backed emptyDir for both.
    shm = mount_of(daemon, "/dev/shm")
    assert mount_of(engine, "/dev/shm")["name"] == shm["name"]
    assert volume(spec, shm["name"])["emptyDir"]["medium"] == "Memory"
    # CUDA IPC: containers share the IPC namespace; the PID namespace only when asked.
    assert spec["shareProcessNamespace"] is True
    assert not spec.get("hostIPC") and not spec.get("hostPID")
    assert all("hostPath" not in v for v in spec["volumes"])
    # The socket's group is the pod's fsGroup, which every container gets: the daemon's group
    # and the socket directory's (setgid) group.
    assert spec["securityContext"]["fsGroup"] == SOCKET_GID
    assert daemon["securityContext"]["runAsGroup"] == SOCKET_GID
    # A native sidecar: started before the engine, stopped after it.
    if daemon in spec.get("initContainers", []):
        assert daemon["restartPolicy"] == "Always"
        assert daemon["startupProbe"]["httpGet"]["path"] == "/readyz"
    check_probes(daemon)
    check_memory_fits_pool(daemon)
    check_hardened(daemon, spec)
    check_gpu_visibility(daemon, spec)


def test_metrics_service_and_servicemonitor_find_the_daemons():
    svc = k8s_object("Service", "kvcellard-metrics")
    assert svc["spec"].get("clusterIP") == "None", "headless: every daemon is a target"
    [port] = svc["spec"]["ports"]
    for workload in (k8s_object("DaemonSet", "kvcellard"), k8s_object("Deployment")):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for k, v in svc["spec"]["selector"].items():
            assert labels.get(k) == v, f"{workload['metadata']['name']} not selected by {k}={v}"
        c = container(pod_spec(workload), "kvcellard")
        ports = {p["containerPort"] for p in c["ports"]} | {p.get("name") for p in c["ports"]}
        assert port["targetPort"] in ports
        assert port["targetPort"] in (http_port(), *[p["name"] for p in c["ports"]
                                                     if p["containerPort"] == http_port()])
    sm = k8s_object("ServiceMonitor", "kvcellard")
    for k, v in sm["spec"]["selector"]["matchLabels"].items():
        assert svc["metadata"]["labels"].get(k) == v
    namespaces = sm["spec"]["namespaceSelector"]
    assert namespaces.get("any") is True or svc["metadata"]["namespace"] in namespaces.get("matchNames", [])
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [port["name"]]
    assert sm["spec"]["endpoints"][0].get("path", "/metrics") == "/metrics"
    # job="kvcellard", as with prometheus.yml: the rules and the dashboard select on it.
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == JOB


# ---- The ConfigMap's configuration -----------------------------------------------------------

def test_configmap_config_passes_check_config(tmp_path):
    path = tmp_path / "kvcellard.yaml"
    path.write_text(embedded_config_text())
    # As shipped: no path in it has to exist for the check (the socket directory is made by
    # the pod), so no override is needed.
    res = run([KVCELLARD, "--config", str(path), "--check-config"], timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "configuration ok" in res.stdout + res.stderr
    # The check is real: a broken copy fails, naming the key.
    bad = tmp_path / "bad.yaml"
    bad.write_text(embedded_config_text().replace("capacity: 1GiB", "capacty: 1GiB"))
    res = run([KVCELLARD, "--config", str(bad), "--check-config"], timeout=30)
    assert res.returncode == 1 and "pool.capacity" in res.stdout + res.stderr
    # The per-workload --set flags pass too.
    for workload in (k8s_object("DaemonSet", "kvcellard"), k8s_object("Deployment")):
        args = container(pod_spec(workload), "kvcellard")["args"]
        res = run([KVCELLARD, *args[2:], "--config", str(path), "--check-config"], timeout=30)
        assert res.returncode == 0, (args, res.stdout + res.stderr)


def test_configmap_config_runs_a_daemon(daemon_factory, tmp_path):
    path = tmp_path / "kvcellard.yaml"
    path.write_text(embedded_config_text())
    # Pod-only values overridden: the socket and HTTP address (daemon_factory's --set: a temp
    # socket, 127.0.0.1:0 instead of 0.0.0.0:9740), the pool size, and the device (cuda in the
    # pod, sim here).
    assert embedded_config()["listen"]["unix_socket_group"] == ""
    d = daemon_factory(args=["--config", str(path), "--set", "device.kind=sim"])
    st = os.stat(d.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == int(embedded_config()["listen"]["unix_socket_mode"], 8)
    # The daemon's group (runAsGroup in the pod), as the pod specs rely on.
    assert st.st_gid == os.getegid()
    assert http_get(f"http://{d.http}/readyz")[0] == 200
    assert http_get(f"http://{d.http}/healthz")[0] == 200
    assert d.stop() == 0


# ---- Seccomp ---------------------------------------------------------------------------------

def seccomp_profile():
    with open(SECCOMP) as f:
        return json.load(f)


def allowed_rules(profile, name):
    return [r for r in profile["syscalls"] if name in r["names"] and r["action"] == "SCMP_ACT_ALLOW"]


DANGEROUS = ["unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "ptrace",
             "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "keyctl", "add_key",
             "request_key", "userfaultfd", "kexec_load", "kexec_file_load", "init_module",
             "finit_module", "delete_module", "open_by_handle_at", "pidfd_getfd", "reboot",
             "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "iopl", "ioperm",
             "fsopen", "fsmount", "move_mount", "open_tree", "syslog", "clone3", "personality"]


def test_seccomp_profile_allows_io_uring_and_denies_the_rest():
    profile = seccomp_profile()
    # An allowlist in the OCI/containerd format.
    assert profile["defaultAction"] in ("SCMP_ACT_ERRNO", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL")
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= set(profile["architectures"])
    for rule in profile["syscalls"]:
        assert rule["names"] and rule["action"].startswith("SCMP_ACT_"), rule
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        rules = allowed_rules(profile, name)
        assert rules and all(not r.get("args") for r in rules), f"{name} must be allowed outright"
    for name in DANGEROUS:
        assert not allowed_rules(profile, name), f"{name} must not be allowed"
    # clone only without namespace flags (CLONE_NEWNS|NEWUSER|NEWPID|NEWNET|...).
    new_ns = 0x00020000 | 0x10000000 | 0x20000000 | 0x40000000
    for rule in allowed_rules(profile, "clone"):
        [arg] = rule["args"]
        assert arg["op"] == "SCMP_CMP_MASKED_EQ" and arg["value"] & new_ns == new_ns
        assert arg.get("valueTwo", 0) == 0
    # socket() limited to the families the daemon uses.
    families = {r["args"][0]["value"] for r in allowed_rules(profile, "socket")}
    assert families == {1, 2, 10, 16}  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK


# Loads an OCI seccomp profile with libseccomp (as runc and crun do) and execs a command under it.
SECCOMP_EXEC = r'''
import ctypes, json, os, sys
ALLOW = 0x7FFF0000
OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5,
       "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]
lib = ctypes.CDLL(sys.argv[1])
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                       ctypes.c_uint, ctypes.POINTER(ArgCmp)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
def action(name, errno_ret):
    if name == "SCMP_ACT_ALLOW":
        return ALLOW
    if name == "SCMP_ACT_ERRNO":
        return 0x00050000 | ((1 if errno_ret is None else errno_ret) & 0xFFFF)
    sys.exit("unsupported action " + name)
with open(sys.argv[2]) as f:
    profile = json.load(f)
ctx = lib.seccomp_init(action(profile["defaultAction"], profile.get("defaultErrnoRet")))
for rule in profile["syscalls"]:
    act = action(rule["action"], rule.get("errnoRet"))
    cmps = [ArgCmp(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0))
            for a in rule.get("args", [])]
    arr = (ArgCmp * max(1, len(cmps)))(*cmps)
    for name in rule["names"]:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            continue  # not a syscall of this architecture: runc skips these as well
        rc = lib.seccomp_rule_add_array(ctx, act, nr, len(cmps), arr)
        if rc != 0:
            sys.exit("seccomp_rule_add(%s): %d" % (name, rc))
rc = lib.seccomp_load(ctx)
if rc != 0:
    sys.exit("seccomp_load: %d" % rc)
os.execv(sys.argv[3], sys.argv[3:])
'''

# Probes under a filter: io_uring_setup, and clone with CLONE_NEWUSER. Prints JSON.
SYSCALL_PROBE = r'''
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
seccomp = ctypes.CDLL(sys.argv[1])
seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
nr = lambda name: seccomp.seccomp_syscall_resolve_name(name.encode())
out = {}
params = ctypes.create_string_buffer(120)
fd = libc.syscall(nr("io_uring_setup"), 4, params)
out["io_uring_setup"] = 0 if fd >= 0 else ctypes.get_errno()
if fd >= 0:
    os.close(fd)
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
pid = libc.syscall(nr("clone"), CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
out["clone_newuser"] = 0 if pid > 0 else ctypes.get_errno()
if pid > 0:
    os.waitpid(pid, 0)
print(json.dumps(out))
'''

NATIVE_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}


@pytest.fixture
def seccomp_exec(tmp_path):
    """argv prefix that runs a command under a profile: seccomp_exec(profile_path) + [cmd...]."""
    lib = ctypes.util.find_library("seccomp")
    if lib is None:
        pytest.skip("libseccomp is not installed")
    if platform.machine() not in NATIVE_ARCH:
        pytest.skip(f"profile targets x86_64 and aarch64, not {platform.machine()}")
    helper = tmp_path / "seccomp_exec.py"
    helper.write_text(SECCOMP_EXEC)
    probe = tmp_path / "syscall_probe.py"
    probe.write_text(SYSCALL_PROBE)

    def prefix(profile_path):
        return [sys.executable, str(helper), lib, str(profile_path)]

    prefix.lib = lib
    prefix.probe = [sys.executable, str(probe), lib]
    return prefix


def test_seccomp_profile_runs_kvcellard(seccomp_exec, tmp_path):
    assert NATIVE_ARCH[platform.machine()] in seccomp_profile()["architectures"]
    # kvcellard under the profile: starts, serves engines (sim device: shared memory, the copy
    # threads, completion signals), metrics and health, kvcellarctl (run under it as well, as
    # kubectl exec would), and drains on SIGTERM.
    d = Daemon(tmp_path, args=["--set", "device.kind=sim"])
    d.args = seccomp_exec(SECCOMP) + d.args
    try:
        d.start()
        drive_traffic(d)
        status, text = http_get(f"http://{d.http}/metrics")
        assert status == 200 and "kvcellar_pool_used_bytes" in text
        assert http_get(f"http://{d.http}/readyz")[0] == 200
        res = run(seccomp_exec(SECCOMP) + [KVCELLARCTL, "--addr", d.socket, "--json", "status"],
                  timeout=30)
        assert res.returncode == 0, res.stdout + res.stderr
        assert json.loads(res.stdout)["ready"] is True
        assert d.stop() == 0, d.log()
    finally:
        if d.proc and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_seccomp_profile_allows_io_uring_at_runtime(seccomp_exec, tmp_path):
    unfiltered = json.loads(run(seccomp_exec.probe, check=True).stdout)
    if unfiltered["io_uring_setup"] != 0:
        pytest.skip(f"io_uring_setup fails without any filter here (errno {unfiltered['io_uring_setup']})")
    res = run(seccomp_exec(SECCOMP) + seccomp_exec.probe)
    assert res.returncode == 0, res.stdout + res.stderr
    filtered = json.loads(res.stdout)
    assert filtered["io_uring_setup"] == 0, "the profile must allow io_uring_setup"
    if unfiltered["clone_newuser"] == 0:
        assert filtered["clone_newuser"] == 1, "clone(CLONE_NEWUSER) must fail with EPERM"
    # The check is real: without the io_uring rule the same probe gets EPERM.
    profile = seccomp_profile()
    for rule in profile["syscalls"]:
        rule["names"] = [n for n in rule["names"] if not n.startswith("io_uring_")]
    profile["syscalls"] = [r for r in profile["syscalls"] if r["names"]]
    stripped = tmp_path / "no-io-uring.json"
    stripped.write_text(json.dumps(profile))
    res = run(seccomp_exec(stripped) + seccomp_exec.probe)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["io_uring_setup"] == 1


# ---- Prometheus files ------------------------------------------------------------------------

def test_promtool_checks_config_and_rules():
    # rule_files in prometheus.yml is relative to the file, so it checks in place.
    res = run(["promtool", "check", "config", PROM_CONFIG], timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 rule files found" in res.stdout + res.stderr
    res = run(["promtool", "check", "rules", ALERTS], timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    res = run(["promtool", "test", "rules", ALERTS_TEST], timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # Every alert has a unit test.
    tested = {t["alertname"] for case in yaml_docs(ALERTS_TEST)[0]["tests"]
              for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert tested == {r["alert"] for r in alert_rules()}
    for r in alert_rules():
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_prometheus_jobs_label_series_job_kvcellard():
    config = yaml_docs(PROM_CONFIG)[0]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert JOB in jobs
    # The Kubernetes job is kept in a comment (Debian's Prometheus lacks Kubernetes discovery):
    # it must still parse, keep only kvcellard containers' metrics port, and relabel job.
    with open(PROM_CONFIG) as f:
        text = f.read()
    block = re.search(r"^  # - job_name: kvcellard-kubernetes\n(?:  #.*\n)+", text, re.M)
    assert block, "commented kubernetes_sd job missing"
    uncommented = "\n".join(line[4:] if line.startswith("  # ") else line[3:]
                            for line in block.group(0).splitlines())
    [k8s_job] = yaml.safe_load(uncommented)
    assert k8s_job["kubernetes_sd_configs"] == [{"role": "pod"}]
    keep = k8s_job["relabel_configs"][0]
    assert keep["action"] == "keep"
    ports = {p["name"] for w in (k8s_object("DaemonSet", "kvcellard"), k8s_object("Deployment"))
             for p in container(pod_spec(w), "kvcellard")["ports"]}
    assert any(re.fullmatch(keep["regex"], f"kvcellard;{p}") for p in ports)
    assert {"target_label": "job", "replacement": JOB} in k8s_job["relabel_configs"]


# ---- Grafana ---------------------------------------------------------------------------------

def test_grafana_dashboard_is_well_formed():
    dash = dashboard()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in all_panels(dash):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["title"] and p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
    for where, expr in dashboard_exprs(dash):
        for var in re.findall(r"\$\{?(\w+)", expr):
            assert var in variables or var.startswith("__"), f"{where}: undefined ${var}"
    kinds = {p["type"] for p in all_panels(dash)}
    assert {"row", "stat", "timeseries", "table"} <= kinds
    # The promised panels: RPC rate, errors, latency quantiles, pool, process, build info.
    exprs = " ".join(e for _, e in dashboard_exprs(dash))
    for needle in ("rate(kvcellar_rpc_requests_total", "histogram_quantile(0.99",
                   "kvcellar_rpc_duration_seconds_bucket", "kvcellar_pool_capacity_bytes",
                   "kvcellar_pool_used_bytes", "process_cpu_seconds_total",
                   "process_resident_memory_bytes", "kvcellar_build_info",
                   # The tiers: hit ratio per tier, bandwidth per direction, L3 errors per backend
                   # and reason, prefetch outcomes, pool use per size class, namespaces.
                   "kvcellar_match_l3_tier_tokens_total", "kvcellar_transfer_duration_seconds_sum",
                   "sum by (tier, backend, reason) (rate(kvcellar_l3_errors_total",
                   "kvcellar_l3_writes_total", "kvcellar_prefetch_pages_total",
                   "kvcellar_pool_class_capacity_bytes", "kvcellar_l3_evicted_objects_total",
                   "kvcellar_namespace_hit_tokens_total", "kvcellar_session_lease_expiries_total"):
        assert needle in exprs, needle


# ---- Against a running daemon ----------------------------------------------------------------

def test_referenced_metrics_are_exported(daemon_factory, tmp_path, redis_server):
    # With L3 tiers: the L3 panels and alerts need their series.
    d = drive_l3_traffic(daemon_factory, tmp_path, redis_server)
    status, text = http_get(f"http://{d.http}/metrics")
    assert status == 200
    exported = exported_names(text)
    referenced = {}
    for where, expr in dashboard_exprs(dashboard()) + rule_exprs():
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name in names:
            referenced.setdefault(name, where)
    missing = []
    for name, where in sorted(referenced.items()):
        if name in EXTERNAL_METRICS or name.startswith("process_"):
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in exported and base not in exported:
            missing.append(f"{name} ({where})")
    assert not missing, "not exported by kvcellard: " + ", ".join(missing)
    assert any(n.startswith("kvcellar_") for n in referenced)


def test_metrics_catalogue_matches_the_daemon(daemon_factory, tmp_path, redis_server):
    """docs/metrics.md lists every family a daemon with L3 tiers exports after engine traffic,
    with its type and labels (and, where it lists them, every label value), and nothing it does
    not export; promtool accepts the scrape."""
    d = drive_l3_traffic(daemon_factory, tmp_path, redis_server)
    status, text = http_get(f"http://{d.http}/metrics")
    assert status == 200
    catalogue = metrics_catalogue()
    families = exported_families(text)
    undocumented = sorted(set(families) - set(catalogue))
    assert not undocumented, "exported but not in docs/metrics.md: " + ", ".join(undocumented)
    unexported = sorted(set(catalogue) - set(families))
    assert not unexported, "in docs/metrics.md but not exported: " + ", ".join(unexported)
    for name, kind in families.items():
        assert catalogue[name][0] == kind, f"{name}: exported as {kind}, documented {catalogue[name][0]}"
    problems = set()
    for name, labels, _ in parse_samples(text):
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in families else name
        documented = catalogue[family][1]
        for label, value in labels.items():
            if label == "le" and families[family] == "histogram":
                continue
            if label not in documented:
                problems.add(f"{family}: label {label} not documented")
            elif documented[label] is not None and value not in documented[label]:
                problems.add(f"{family}: {label}={value!r} not among the documented values")
    assert not problems, "\n".join(sorted(problems))
    # The traffic reached every tier and direction the catalogue promises.
    tiers = {"nvme"} | ({"redis"} if redis_server else set())
    samples = parse_samples(text)
    assert {l["tier"] for n, l, _ in samples if n == "kvcellar_l3_used_bytes"} == tiers
    assert {l["backend"] for n, l, _ in samples if n == "kvcellar_l3_errors_total"} == (
        {"file", "redis"} if redis_server else {"file"})
    hit = [v for n, l, v in samples if n == "kvcellar_match_l3_tier_tokens_total"
           and l == {"tier": "nvme", "result": "hit"}]
    assert hit == [L3_PAGES * L3_GEOMETRY["page_size"]], hit
    for direction in ("h2d", "d2h", "l3_to_l2"):
        [count] = [v for n, l, v in samples if n == "kvcellar_transfer_duration_seconds_count"
                   and l == {"direction": direction}]
        assert count >= 1, direction
    models = {l["model"] for n, l, _ in samples if n == "kvcellar_namespace_lookup_tokens_total"}
    assert L3_GEOMETRY["model"] in models, models
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr


def test_namespace_series_are_capped(daemon_factory):
    """Past http.max_namespace_series (tenant, model) pairs, namespaces share tenant="other",
    model="other": engines cannot grow the label set without bound."""
    d = daemon_factory(args=["--set", "device.kind=sim", "--set", "http.max_namespace_series=1"])
    for model in ("model-a", "model-b", "model-c"):
        r = run_engine(d.socket, "load", instance=model, model=model, tokens_seed=3, pages=2,
                       verify_seed=1)
        assert r.rc in (0, 4), r.describe()  # 4: the expected misses of an empty cache
    status, text = http_get(f"http://{d.http}/metrics")
    assert status == 200
    series = {(l["tenant"], l["model"]): v for n, l, v in parse_samples(text)
              if n == "kvcellar_namespace_match_requests_total"}
    assert set(series) == {("", "model-a"), ("other", "other")}, series
    assert series[("other", "other")] == 2 * series[("", "model-a")] > 0, series


def test_dashboard_and_rules_use_documented_metrics():
    catalogue = metrics_catalogue()
    undocumented = []
    for where, expr in dashboard_exprs(dashboard()) + rule_exprs():
        for name in promql_metric_names(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name in EXTERNAL_METRICS or name in catalogue or (
                    base in catalogue and catalogue[base][0] == "histogram"):
                continue
            undocumented.append(f"{name} ({where})")
    assert not undocumented, "not in docs/metrics.md: " + ", ".join(undocumented)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, tmp_path, config):
        self.dir = tmp_path
        self.config = tmp_path / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.proc = None
        self.url = None

    def start(self, timeout=30):
        for _ in range(3):  # the free port may be taken between probe and bind: retry
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            log = open(self.dir / f"prometheus-{port}.log", "w")
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={self.config}",
                 f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if http_get(self.url + "/-/ready", timeout=1)[0] == 200:
                        return self
                except OSError:
                    pass
                time.sleep(0.2)
            self.stop()
        raise AssertionError("prometheus did not start:\n" + self.log())

    def log(self):
        return "\n".join(open(p).read() for p in sorted(glob.glob(str(self.dir / "prometheus-*.log"))))

    def api(self, path, **params):
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        data = json.loads(body)
        assert status == 200 and data["status"] == "success", (path, params, body)
        return data["data"]

    def query(self, expr):
        return self.api("query", query=expr)["result"]

    def wait_for(self, what, pred, timeout=30):
        try:
            return wait_until(pred, timeout=timeout, interval=0.25, what=what)
        except AssertionError as e:
            raise AssertionError(f"prometheus: {e}\n" + self.log()) from None

    def stop(self):
        end_process(self.proc)


def test_prometheus_scrapes_the_daemon(daemon_factory, tmp_path, redis_server):
    capacity = 128 << 20  # not the harness default, so the comparison means something
    # The reader of two daemons sharing L3 tiers, after L3 and L2 traffic.
    d = drive_l3_traffic(daemon_factory, tmp_path, redis_server,
                         "--set", f"pool.capacity={capacity}")
    # The shipped configuration, pointed at the test daemon: its kvcellard job with a static
    # target instead of the file list, 1 s intervals, the shipped alert rules.
    config = yaml_docs(PROM_CONFIG)[0]
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == JOB]
    job.pop("file_sd_configs", None)
    job["static_configs"] = [{"targets": [d.http]}]
    job["scrape_interval"] = job["scrape_timeout"] = "1s"
    config["scrape_configs"] = [job]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [ALERTS]
    prom = Prometheus(tmp_path, config)
    try:
        prom.start()
        build = prom.wait_for("kvcellar_build_info", lambda: prom.query(f'kvcellar_build_info{{job="{JOB}"}}'))
        assert len(build) == 1 and build[0]["value"][1] == "1", build
        assert build[0]["metric"]["instance"] == d.http
        assert build[0]["metric"]["version"]
        [up] = prom.query(f'up{{job="{JOB}"}}')
        assert up["value"][1] == "1"
        [cap] = prom.query("kvcellar_pool_capacity_bytes")
        assert int(cap["value"][1]) == int(daemon_status(d)["pool"]["capacity_bytes"]) == capacity
        [used] = prom.query("sum(kvcellar_pool_used_bytes)")
        assert int(used["value"][1]) > 0, "the Backup's pages are in the pool"
        # L3 series read back through the query API: what the prefetch moved, per-tier hits.
        [moved] = prom.query('kvcellar_moved_bytes_total{direction="l3_to_l2"}')
        assert float(moved["value"][1]) == metric_value(
            d, "kvcellar_moved_bytes_total", direction="l3_to_l2") > 0
        [hits] = prom.query('kvcellar_match_l3_tier_tokens_total{tier="nvme",result="hit"}')
        assert int(hits["value"][1]) == L3_PAGES * L3_GEOMETRY["page_size"]
        # Two scrapes so that rate() has points, then every dashboard query evaluates.
        prom.wait_for("two scrapes", lambda: prom.query(f'count_over_time(up{{job="{JOB}"}}[1m]) >= 3'))
        for where, expr in dashboard_exprs(dashboard()):
            status, body = http_get(f"{prom.url}/api/v1/query?"
                                    + urllib.parse.urlencode({"query": grafana_to_promql(expr)}))
            assert status == 200 and json.loads(body)["status"] == "success", f"{where}: {body}"
        # The variables' queries find this daemon.
        [series] = prom.query(grafana_to_promql(
            label_values_selector(next(v for v in dashboard()["templating"]["list"]
                                       if v["name"] == "instance")["query"]["query"])[0]))
        assert series["metric"]["instance"] == d.http
        # A panel with data: the RPC rate by method includes the Backup the engine made.
        [panel_expr] = [e for w, e in dashboard_exprs(dashboard()) if "by (service, method) (rate(kvcellar_rpc_requests_total" in e]
        methods = {s["metric"]["method"] for s in prom.query(grafana_to_promql(panel_expr))}
        assert {"Backup", "Load", "Match"} <= methods, methods
        # Every alert rule evaluates cleanly against real data.
        def rules_evaluated():
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            if len(rules) != len(alert_rules()):
                return None
            if any(r.get("lastEvaluation", "").startswith("0001") for r in rules):
                return None
            return rules
        rules = prom.wait_for("rule evaluation", rules_evaluated)
        for r in rules:
            assert r["health"] == "ok", r
            assert r["state"] == "inactive", r
        # The daemon goes away: up drops to 0 and KvcellarDown is pending (it fires after 2m).
        assert d.stop() == 0

        def down_pending():
            return [a for a in prom.api("alerts")["alerts"]
                    if a["labels"]["alertname"] == "KvcellarDown"
                    and a["labels"]["instance"] == d.http and a["state"] == "pending"]
        prom.wait_for("KvcellarDown pending", down_pending, timeout=20)
    finally:
        prom.stop()
