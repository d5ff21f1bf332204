"""Shared by the package and image tests (test_deb.py, test_container.py, the package's
test_wheel.py): commands that must succeed, fresh Debian root file systems, and the daemon's
Debian package made from this build's binaries."""
import contextlib
import os
import shutil
import subprocess

from conftest import BIN_DIR

BUILD_DIR = os.path.dirname(os.path.abspath(BIN_DIR))


def sh(*cmd, root=None, check=True, timeout=600, env=None):
    """Runs cmd (in a chroot of `root` when given), non-interactive; with `check`, a failure is
    an AssertionError carrying the end of its output."""
    if root is not None:
        cmd = ("chroot", str(root), *cmd)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C",
                                **(env or {})))
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))}: exit {p.returncode}\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def build_deb(dest):
    """kvcellard_<version>_amd64.deb made by CPack from this build's binaries into `dest`."""
    sh("cpack", "-G", "DEB", "--config", os.path.join(BUILD_DIR, "CPackConfig.cmake"),
       "-B", str(dest))
    (deb,) = [p for p in os.listdir(dest) if p.endswith("_amd64.deb")]
    return os.path.join(str(dest), deb)


def mirror():
    """The Debian registry this machine's apt uses."""
    for path in ("/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"):
        if not os.path.exists(path):
            continue
        for line in open(path):
            words = line.split()
            if words[:1] == ["URIs:"] and "security" not in words[1]:
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return next(w for w in words[1:] if w.startswith("http"))
    return "http://deb.debian.org/debian"


@contextlib.contextmanager
def debian_root(root, include=()):
    """A fresh Debian 12 (minbase, plus the packages in `include`) root file system at `root`,
    made with debootstrap from Debian's registry, with /proc and the host's /dev/shm (the sim
    device's engine memory) mounted; removed afterwards."""
    assert os.geteuid() == 0, "needs root: chroot and mounts"
    assert shutil.which("debootstrap"), "debootstrap missing: deploy/install-deps.sh system"
    extra = ["--include=" + ",".join(include)] if include else []
    sh("debootstrap", "--variant=minbase", *extra, "bookworm", str(root), mirror(), timeout=900)
    shutil.copy("/etc/resolv.conf", os.path.join(root, "etc/resolv.conf"))
    mounts = []
    try:
        for what, where, opts in (("proc", "proc", ["-t", "proc"]),
                                  ("/dev/shm", "dev/shm", ["--bind"])):
            target = os.path.join(root, where)
            os.makedirs(target, exist_ok=True)
            sh("mount", *opts, what, target)
            mounts.append(target)
        yield root
    finally:
        for m in reversed(mounts):
            sh("umount", "-l", m, check=False)
        # Never remove the tree while the host's /dev/shm is still mounted inside it.
        if not any(os.path.ismount(m) for m in mounts):
            shutil.rmtree(root, ignore_errors=True)
