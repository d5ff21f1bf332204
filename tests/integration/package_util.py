"""Shared by the package and image tests (test_deb.py, test_container.py): commands that must
succeed, and the daemon's Debian package made from this build's binaries."""
import os
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
