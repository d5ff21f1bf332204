"""Deployment glue: systemd readiness (sd_notify) and the systemd unit.

Interpreter: Debian's /usr/bin/python3.
"""
import os
import shutil
import signal
import socket

import pytest

from conftest import KVCELLARD, SOURCE_DIR, run

UNIT = os.path.join(SOURCE_DIR, "deploy/systemd/kvcellard.service")


def test_sd_notify_ready_and_stopping(daemon_factory, tmp_path):
    notify_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    sock.settimeout(20)
    try:
        daemon = daemon_factory(env={"NOTIFY_SOCKET": notify_path})
        ready = sock.recv(4096).decode()
        assert "READY=1" in ready.splitlines(), ready
        assert f"MAINPID={daemon.proc.pid}" in ready.splitlines(), ready
        # READY comes after the listeners serve: the socket accepts connections now.
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(daemon.socket)
        probe.close()
        daemon.proc.send_signal(signal.SIGTERM)
        stopping = sock.recv(4096).decode()
        assert "STOPPING=1" in stopping.splitlines(), stopping
        assert daemon.proc.wait(20) == 0
    finally:
        sock.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path):
    text = open(UNIT).read()
    assert "Type=notify" in text and "LimitMEMLOCK=infinity" in text
    assert "RuntimeDirectory=kvcellar" in text
    # systemd-analyze checks that ExecStart's binary exists: point it at the build's daemon.
    unit = tmp_path / "kvcellard.service"
    unit.write_text(text.replace("/usr/local/bin/kvcellard", KVCELLARD))
    res = run(["systemd-analyze", "verify", str(unit)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr.strip() == "", res.stderr
    # The check is real: a unit whose binary is missing fails it.
    unit.write_text(text.replace("/usr/local/bin/kvcellard", str(tmp_path / "missing")))
    assert run(["systemd-analyze", "verify", str(unit)]).returncode != 0


def test_systemd_unit_keeps_the_warm_restart_pool():
    """The pool and its journal (pool.shm_name, docs/restart.md) are shm objects of the service's
    user: the unit must not let systemd remove them when the service stops or crashes, and must
    not hide the host's /dev/shm from the daemon."""
    keys = {}
    for line in open(UNIT):
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            keys[k] = v
    assert keys.get("RemoveIPC") == "no", keys
    assert keys.get("DynamicUser", "no") == "no"  # DynamicUser implies RemoveIPC=yes.
    assert keys.get("PrivateIPC", "no") == "no" and keys.get("PrivateDevices", "no") == "no"

