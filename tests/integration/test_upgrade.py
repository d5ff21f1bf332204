"""Versions and upgrades (docs/versions.md, docs/restart.md "Upgrading").

- The version numbers the repository repeats agree: CMake's project version, the client
  library's name string, the Python package, the Kubernetes manifests' image tag, the newest
  CHANGELOG.md entry, and what `kvcellard --version` prints.
- An upgrade from 0.1.0: what a 0.1.0 daemon left behind after a SIGTERM
  (tests/data/upgrade/0.1.0: its pool and slot journal, its file tier; made by
  tests/data/upgrade/make_fixture.sh with the 0.1.0 binaries) is taken over by today's daemon:
  every page an L2 hit with its bytes verified, and after an L2 eviction every page read back
  from the 0.1.0 file tier, bytes verified.
- Engines keep running while the daemon is stopped with SIGTERM and started again on its pool,
  as an upgrade does: they reconnect, every byte they load verifies, and pages stored before the
  restart are L2 hits after it.
- A downgrade: a journal of a later format version starts L2 empty with the reason, and a file
  tier's objects of a later format are neither indexed nor removed.

Runs under Debian's /usr/bin/python3.
"""
import json
import lzma
import os
import re
import shutil
import signal
import struct
import subprocess
import tarfile
import time

import pytest
import yaml

from conftest import KVCELLARD, SOURCE_DIR
from engine_sim import (DAEMON_ARGS, EXIT_OK, EngineProcess, evict_l2, metric, run_engine,
                        status)

FIXTURES = os.path.join(SOURCE_DIR, "tests", "data", "upgrade")
JOURNAL_VERSION_OFFSET = 8  # core/slot_journal.cc: u32 after the 8-byte magic
OBJECT_VERSION_OFFSET = 8   # storage/object_format.h: u16 after the 8-byte magic


@pytest.fixture
def shm_name(pool_shm_name):
    return pool_shm_name


def daemon_args(shm, l3):
    return (*DAEMON_ARGS, "--set", f"pool.shm_name={shm}", "--set", "pool.capacity=64MiB",
            "--set", f"storage.tiers=file:{l3}?name=nvme",
            "--set", "storage.write_policy=write_through")


def project_version():
    cmake = open(os.path.join(SOURCE_DIR, "CMakeLists.txt")).read()
    return re.search(r"project\(kvcellar VERSION (\d+\.\d+\.\d+)", cmake).group(1)


def test_every_version_number_agrees():
    version = project_version()
    found = {"CMakeLists.txt": version}
    client = open(os.path.join(SOURCE_DIR, "client", "client_types.h")).read()
    found["client/client_types.h"] = re.search(r'"libkvcellar-client (\S+)"', client).group(1)
    pyproject = open(os.path.join(SOURCE_DIR, "client", "python", "pyproject.toml")).read()
    found["pyproject.toml"] = re.search(r'^version = "(\S+)"', pyproject, re.M).group(1)
    for name in ("daemonset.yaml", "sidecar.yaml"):
        for doc in yaml.safe_load_all(open(os.path.join(SOURCE_DIR, "deploy", "k8s", name))):
            text = json.dumps(doc)
            for tag in re.findall(r"kvcellar/kvcellard:([^\"]+)", text):
                found[f"deploy/k8s/{name}"] = tag
    changelog = open(os.path.join(SOURCE_DIR, "CHANGELOG.md")).read()
    found["CHANGELOG.md"] = re.search(r"^## (\d+\.\d+\.\d+)", changelog, re.M).group(1)
    out = subprocess.run([KVCELLARD, "--version"], capture_output=True, text=True, timeout=30)
    found["kvcellard --version"] = out.stdout.split()[1]
    assert set(found.values()) == {version}, found
    # Each release before this one left a fixture its successors are tested against.
    released = re.findall(r"^## (\d+\.\d+\.\d+)", changelog, re.M)[1:]
    for v in released:
        assert os.path.exists(os.path.join(FIXTURES, v, "fixture.json")), v


def unpack_fixture(version, shm, tmp_path):
    d = os.path.join(FIXTURES, version)
    meta = json.load(open(os.path.join(d, "fixture.json")))
    for name, path in (("pool.xz", f"/dev/shm/{shm}"), ("journal.xz", f"/dev/shm/{shm}.journal")):
        with lzma.open(os.path.join(d, name)) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(path, 0o600)
    with tarfile.open(os.path.join(d, "l3.tar.xz")) as t:
        t.extractall(tmp_path)
    return meta


@pytest.mark.parametrize("version", sorted(v for v in os.listdir(FIXTURES)
                                           if os.path.isdir(os.path.join(FIXTURES, v))))
def test_a_previous_versions_pool_journal_and_file_tier_are_taken_over(daemon_factory, tmp_path,
                                                                      shm_name, version):
    meta = unpack_fixture(version, shm_name, tmp_path)
    assert meta["version"] == version
    e = meta["engine"]
    geometry = {k: e[k] for k in ("layers", "block_bytes", "blocks", "page_size", "model")}
    d = daemon_factory(args=daemon_args(shm_name, tmp_path / "l3"), name="upgraded")
    line = d.wait_for_line("l2 recovered")
    assert "warm=true" in line and f"pages={e['pages']}" in line and "dropped=0" in line, line
    rec = status(d).pool.recovery
    assert rec.warm and rec.pages == e["pages"], rec
    d.wait_for_line("l3 tier scanned")

    # Every page of the old daemon's pool, byte for byte.
    r = run_engine(d.socket, "load", instance="after-upgrade", verify_seed=e["seed"],
                   tokens_seed=e["tokens_seed"], pages=e["pages"], first_block=0,
                   prefetch="none", pin=True, **geometry)
    assert r.rc == EXIT_OK and r["hits"] == e["pages"], r.describe()
    assert r["mismatched_bytes"] == 0 and r["verified_bytes"] > 0, r.describe()

    # Out of L2: every page from the old daemon's file tier, byte for byte.
    evict_l2(d)
    r = run_engine(d.socket, "load", instance="from-old-l3", verify_seed=e["seed"],
                   tokens_seed=e["tokens_seed"], pages=e["pages"], first_block=0,
                   prefetch="wait_complete", pin=True, **geometry)
    assert r.rc == EXIT_OK and r["l3_hits"] == e["pages"], r.describe()
    assert r["hits"] == e["pages"] and r["mismatched_bytes"] == 0, r.describe()
    assert metric(d, "kvcellar_l3_objects_total", tier="nvme", op="get", status="ok") >= e["pages"]


GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="upgrade-model")


def test_engines_keep_running_through_a_restart_onto_the_same_pool(daemon_factory, tmp_path,
                                                                   shm_name):
    args = daemon_args(shm_name, tmp_path / "l3")
    d = daemon_factory(args=args, name="before")
    common = dict(tokens_seed=52, pages=6, **GEOMETRY)
    assert run_engine(d.socket, "backup", instance="pre", seed=51, **common).rc == EXIT_OK
    runners = [EngineProcess(d.socket, "random", instance=f"running-{i}", seed=51,
                             duration_s=9, tokens_seed=53, docs=6, max_pages=6,
                             rpc_timeout_ms=300, think_ms=1, **GEOMETRY)
               for i in range(3)]
    time.sleep(2.5)
    d.stop(signal.SIGTERM)  # What systemctl restart and a DaemonSet rollout send.
    d2 = daemon_factory(args=args, name="before")  # The same sockets, pool and tier.
    results = [runner.finish(timeout=60) for runner in runners]
    for r in results:
        assert r.rc == EXIT_OK and r["mismatched_bytes"] == 0, r.describe()
        assert r["stats"]["reregistrations"] >= 1, r.describe()
        assert r["loaded_pages_after_reconnect"] > 0, r.describe()
    # What was stored before the restart is still in L2.
    r = run_engine(d2.socket, "load", instance="post", verify_seed=51, first_block=20,
                   prefetch="none", **common)
    assert r.rc == EXIT_OK and r["hits"] == 6 and r["mismatched_bytes"] == 0, r.describe()
    assert status(d2).pool.recovery.warm


def test_a_downgrade_starts_l2_cold_with_the_reason_and_keeps_newer_l3_objects(
        daemon_factory, tmp_path, shm_name):
    l3 = tmp_path / "l3"
    args = daemon_args(shm_name, l3)
    d = daemon_factory(args=args, name="newer")
    common = dict(tokens_seed=62, pages=4, **GEOMETRY)
    assert run_engine(d.socket, "backup", instance="w", seed=61, **common).rc == EXIT_OK
    deadline = time.monotonic() + 20
    objects = []
    while time.monotonic() < deadline and len(objects) < 4:
        objects = [os.path.join(r, f) for r, _, fs in os.walk(l3) for f in fs if ".tmp" not in f]
        time.sleep(0.05)
    assert len(objects) == 4, objects
    d.stop(signal.SIGTERM)
    # What a later version would have written: its journal format and its object format.
    with open(f"/dev/shm/{shm_name}.journal", "r+b") as f:
        f.seek(JOURNAL_VERSION_OFFSET)
        (v,) = struct.unpack("<I", f.read(4))
        f.seek(JOURNAL_VERSION_OFFSET)
        f.write(struct.pack("<I", v + 1))
    for path in objects:
        with open(path, "r+b") as f:
            f.seek(OBJECT_VERSION_OFFSET)
            (v,) = struct.unpack("<H", f.read(2))
            f.seek(OBJECT_VERSION_OFFSET)
            f.write(struct.pack("<H", v + 1))

    d2 = daemon_factory(args=args, name="older")
    line = d2.wait_for_line("l2 started empty")
    assert "journal format version 2 != 1" in line, line
    rec = status(d2).pool.recovery
    assert not rec.warm and "journal format version" in rec.cold_reason, rec
    d2.wait_for_line("l3 tier scanned")
    assert metric(d2, "kvcellar_l3_scan_objects_total", tier="nvme", result="newer") == 4
    assert metric(d2, "kvcellar_l3_scan_objects_total", tier="nvme", result="dropped") == 0
    # A miss, never an error, and the newer daemon's objects are all still there.
    r = run_engine(d2.socket, "load", instance="r", verify_seed=61, first_block=0,
                   prefetch="wait_complete", l3_lookup_ms=1000, **common)
    assert r.rc == EXIT_OK and r["hits"] == 0 and r["mismatched_bytes"] == 0, r.describe()
    assert all(os.path.exists(p) for p in objects)
