"""`pip install` of the package from the repository: the package's own build (scikit-build-core
over the repository's CMake) compiles libkvcellar-client.so and bundles it, and the installed
package, with nothing from the source tree on its path, computes keys and talks to a daemon."""
import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, numpy as np, kvcellar
assert kvcellar.LIBRARY_PATH.startswith(sys.argv[1]), kvcellar.LIBRARY_PATH
ns = kvcellar.Namespace("tiny-llm", "rev1", "bf16", 4, tenant="acme")
assert ns.digest().hex() == "2eb43a1b297bf3a7e7001fd032c23ee2944a4069f05c73eef4790c49c6475337"
with kvcellar.Client(sys.argv[2]) as c:
    s = c.register("installed", ns, scheduler=True)
    assert s.wait_active(5000)
    m = s.match([np.arange(10)])
    assert m.ok and m.results[0].total_pages == 2, m
print("installed-ok", kvcellar.__version__)
"""


def test_pip_install_builds_and_bundles_the_native_client(tmp_path, daemon):
    target = tmp_path / "site"
    # --no-build-isolation: the venv already has scikit-build-core (requirements-test.txt), so
    # the test needs no index; a user's plain `pip install ./client/python` fetches it.
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
           "--disable-pip-version-check", "--target", str(target),
           "--config-settings=build-dir=" + str(tmp_path / "build"), str(PKG)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lib = target / "kvcellar" / "_lib" / "libkvcellar-client.so"
    assert lib.is_file()
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCELLAR_CLIENT_LIBRARY", "PYTHONPATH")}
    env["PYTHONPATH"] = str(target)
    res = subprocess.run([sys.executable, "-c", CHILD, str(target), daemon.socket],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "installed-ok 0.2.0" in res.stdout
