"""The daemon's Debian package (deploy/debian/package.cmake, `deploy/package.sh deb`) on a fresh
Debian 12: a minimal root file system made with debootstrap from Debian's registry, the package
installed into it with apt (which pulls the shared libraries the binaries link), the daemon run
from it as the package's `kvcellar` user, an engine on the host backing pages up and loading them
back through it (bytes verified), then remove (the config stays) and purge (it goes).

Needs root (chroot, mounts), debootstrap and dpkg-dev (deploy/install-deps.sh system) and
Debian's registry: the README's test command has all three. About a minute, most of it
debootstrap.
"""
import os
import shutil

import pytest

from engine_sim import DAEMON_ARGS, EXIT_OK, run_engine
from kvcellard_process import Daemon
from package_util import build_deb, debian_root, sh

GEOMETRY = dict(layers=2, block_bytes=4096, blocks=16, page_size=16, model="deb-model")
# What the package installs, and nothing else (directories aside).
FILES = {"/usr/bin/kvcellard", "/usr/bin/kvcellarctl", "/lib/systemd/system/kvcellard.service",
         "/etc/kvcellar/kvcellard.yaml", "/usr/share/doc/kvcellard/copyright"}


@pytest.fixture
def debian(tmp_path):
    """A fresh Debian 12 (minbase) root file system (package_util.debian_root)."""
    with debian_root(tmp_path / "debian12") as root:
        yield root


def test_the_deb_installs_on_a_fresh_debian_runs_and_purges_cleanly(debian, tmp_path):
    # The package, from this build's binaries.
    path = build_deb(tmp_path / "pkg")
    deb = os.path.basename(path)
    assert deb.startswith("kvcellard_"), deb
    shutil.copy(path, debian / "tmp" / deb)

    # apt pulls the shared libraries (gRPC, Protobuf, Abseil, ...) a minimal system lacks.
    assert sh("dpkg-query", "-W", "libgrpc++1.51", root=debian, check=False).returncode != 0
    sh("apt-get", "update", root=debian)
    sh("apt-get", "install", "-y", "--no-install-recommends", f"/tmp/{deb}", root=debian)
    listed = sh("dpkg", "-L", "kvcellard", root=debian).stdout.split()
    assert {p for p in listed if os.path.isfile(f"{debian}{p}")} == FILES
    user = sh("getent", "passwd", "kvcellar", root=debian).stdout.split(":")
    assert user[6].strip() == "/usr/sbin/nologin" and int(user[2]) < 1000, user  # a system user
    uid, gid = int(user[2]), int(user[3])
    conf = os.stat(debian / "etc/kvcellar/kvcellard.yaml")
    assert (conf.st_gid, conf.st_mode & 0o777) == (gid, 0o640)
    unit = (debian / "lib/systemd/system/kvcellard.service").read_text()
    assert "ExecStart=/usr/bin/kvcellard --config /etc/kvcellar/kvcellard.yaml" in unit
    assert "/usr/local" not in unit
    check = sh("kvcellard", "--check-config", "--config", "/etc/kvcellar/kvcellard.yaml",
               root=debian)
    assert "ok" in (check.stdout + check.stderr).lower(), check

    # The daemon from the package, as its user, where systemd's RuntimeDirectory would put it.
    run_dir = debian / "run/kvcellar"
    os.makedirs(run_dir, exist_ok=True)
    os.chown(run_dir, uid, gid)
    os.chmod(run_dir, 0o750)
    d = Daemon(tmp_path, name="deb")
    d.args = ["chroot", "--userspec=kvcellar:kvcellar", str(debian), "/usr/bin/kvcellard",
              "--config", "/etc/kvcellar/kvcellard.yaml", *DAEMON_ARGS,
              "--set", "http.address=127.0.0.1:0", "--set", "pool.capacity=64MiB"]
    d.env = dict(os.environ, RUNTIME_DIRECTORY="/run/kvcellar")
    d.socket = str(run_dir / "kvcellard.sock")
    try:
        d.start()
        assert os.stat(d.socket).st_uid == uid
        # An engine on the host (root, its sim memory in the shared /dev/shm) through it.
        flags = dict(seed=5, tokens_seed=6, pages=8, shm_mode="0666", **GEOMETRY)
        r = run_engine(d.socket, "backup", instance="deb-writer", **flags)
        assert r.rc == EXIT_OK and r["stored"] == 8, r.describe()
        r = run_engine(d.socket, "load", instance="deb-reader", verify_seed=5, tokens_seed=6,
                       pages=8, first_block=0, shm_mode="0666", **GEOMETRY)
        assert r.rc == EXIT_OK and r["hits"] == 8 and r["mismatched_bytes"] == 0, r.describe()
    finally:
        d.stop()

    # Remove keeps the (edited) config; purge removes it and the directory.
    with open(debian / "etc/kvcellar/kvcellard.yaml", "a") as f:
        f.write("# edited by the operator\n")
    sh("apt-get", "remove", "-y", "kvcellard", root=debian)
    assert not os.path.exists(debian / "usr/bin/kvcellard")
    assert "edited by the operator" in (debian / "etc/kvcellar/kvcellard.yaml").read_text()
    sh("apt-get", "purge", "-y", "kvcellard", root=debian)
    assert not os.path.exists(debian / "etc/kvcellar")
    assert sh("dpkg-query", "-W", "kvcellard", root=debian, check=False).returncode != 0
