"""kvcellard's container image (deploy/container/Containerfile, deploy/container/build.sh): built
from Debian packages only, it agrees with the Kubernetes manifests that run it (image reference,
user, volumes, port, entrypoint, the init container's tools), and its root file system, run the
way the DaemonSet runs it (read-only root, the ConfigMap's config mounted read-only, writable
/run/kvcellar, /tmp and the L3 directory, as user 65532:2000), starts kvcellard and serves an
engine's backups and loads with every byte verified.

podman is not used: the image is unpacked with umoci (the OCI runtime bundle podman would run)
and run in a chroot with the same mounts. Needs root, debootstrap, buildah, umoci and Debian's
registry (deploy/install-deps.sh system). About 1.5 minutes, most of it debootstrap.
"""
import json
import os
import shutil

import pytest
import yaml

from conftest import SOURCE_DIR
from engine_sim import DAEMON_ARGS, EXIT_OK, run_engine
from kvcellard_process import Daemon
from package_util import build_deb, sh

K8S = os.path.join(SOURCE_DIR, "deploy", "k8s")
GEOMETRY = dict(layers=2, block_bytes=4096, blocks=16, page_size=16, model="image-model")


def manifests():
    """The kvcellard containers of the DaemonSet and the sidecar pod, with their pod specs."""
    out = []
    for name in ("daemonset.yaml", "sidecar.yaml"):
        for doc in yaml.safe_load_all(open(os.path.join(K8S, name))):
            if not doc or doc.get("kind") not in ("DaemonSet", "Deployment", "Pod", "StatefulSet"):
                continue
            pod = doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                if "kvcellar/kvcellard" in c["image"]:
                    out.append((name, pod, c))
    return out


def image_config(layout, tag):
    """The OCI image config of layout:tag."""
    index = json.load(open(os.path.join(layout, "index.json")))
    (desc,) = [m for m in index["manifests"]
               if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag]
    blob = lambda d: os.path.join(layout, "blobs", *d["digest"].split(":"))  # noqa: E731
    manifest = json.load(open(blob(desc)))
    return json.load(open(blob(manifest["config"])))


@pytest.fixture
def built(tmp_path):
    assert os.geteuid() == 0, "needs root: debootstrap, chroot, mounts"
    for tool in ("debootstrap", "buildah", "umoci"):
        assert shutil.which(tool), f"{tool} missing: deploy/install-deps.sh system"
    deb = build_deb(tmp_path / "pkg")
    layout = tmp_path / "image"
    out = sh(os.path.join(SOURCE_DIR, "deploy", "container", "build.sh"), deb,
             env={"OUT_DIR": str(layout)}, timeout=900).stdout.split()
    image, ref = out[-2], out[-1]
    try:
        yield image, str(layout), ref.rsplit(":", 1)[1]
    finally:
        sh("buildah", "rmi", image, check=False)


def test_the_image_agrees_with_the_manifests_and_serves_from_a_read_only_root(built, tmp_path):
    image, layout, tag = built
    config = image_config(layout, tag)["config"]
    containers = manifests()
    assert {c["name"] for _, _, c in containers} >= {"kvcellard", "socket-dir"}

    # The manifests run this image, as its user, with its entrypoint.
    for name, pod, c in containers:
        assert c["image"] == image, (name, c["image"])
        ctx = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
        if c["name"] == "socket-dir":  # Runs as root to chown the directories, with sh.
            assert ctx["runAsUser"] == 0 and c["command"][0] == "/bin/sh"
            continue
        assert f"{ctx['runAsUser']}:{ctx['runAsGroup']}" == config["User"], (name, ctx)
        assert ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"]
        assert "command" not in c and c["args"][:2] == ["--config", "/etc/kvcellar/kvcellard.yaml"]
        # Every writable mount is a volume of the image; the config and /dev/shm come from the
        # pod.
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert writable - {"/dev/shm"} <= set(config["Volumes"]), (name, writable)
        for p in c.get("ports", []):
            assert f"{p['containerPort']}/tcp" in config["ExposedPorts"]
    assert config["Entrypoint"] == ["/usr/bin/kvcellard"]
    assert config["Cmd"] == ["--config", "/etc/kvcellar/kvcellard.yaml"]
    assert "RUNTIME_DIRECTORY=/run/kvcellar" in config["Env"]

    # The runtime bundle podman would run.
    bundle = tmp_path / "bundle"
    sh("umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle))
    rootfs = bundle / "rootfs"
    spec = json.load(open(bundle / "config.json"))
    assert (spec["process"]["user"]["uid"], spec["process"]["user"]["gid"]) == (65532, 2000)
    for tool in ("bin/sh", "bin/chown", "bin/chmod", "usr/bin/kvcellard", "usr/bin/kvcellarctl"):
        assert os.path.exists(rootfs / tool), tool
    assert not os.path.exists(rootfs / "var/lib/apt/lists/lock")  # apt's lists are dropped
    du = sum(f.stat().st_size for f in rootfs.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"image root file system: {du / 2**20:.0f} MiB")

    # Run it as the DaemonSet does: read-only root, the ConfigMap's config read-only, the socket
    # directory shared with the engines, /tmp and the L3 directory writable; /dev/shm is the
    # host's (the sim device's engine memory; hostIPC in the DaemonSet).
    cm = next(d for d in yaml.safe_load_all(open(os.path.join(K8S, "configmap.yaml")))
              if d and d.get("kind") == "ConfigMap")
    etc = tmp_path / "etc-kvcellar"
    etc.mkdir()
    (etc / "kvcellard.yaml").write_text(cm["data"]["kvcellard.yaml"])
    os.chmod(etc / "kvcellard.yaml", 0o644)
    run_dir, l3 = tmp_path / "run-kvcellar", tmp_path / "l3"
    for d, mode in ((run_dir, 0o750), (l3, 0o700)):
        d.mkdir()
        os.chown(d, 65532, 2000)
        os.chmod(d, mode)
    mounts = [("--bind", str(rootfs), str(rootfs)),
              ("-o", "remount,bind,ro", str(rootfs), None),
              ("-t", "proc", "proc", str(rootfs / "proc")),
              ("--bind", "/dev/shm", str(rootfs / "dev/shm")),
              ("-t", "tmpfs", "tmpfs", str(rootfs / "tmp")),
              ("--bind", str(run_dir), str(rootfs / "run/kvcellar")),
              ("--bind", str(l3), str(rootfs / "var/lib/kvcellar/l3")),
              ("--bind", str(etc), str(rootfs / "etc/kvcellar"))]
    done = []
    d = Daemon(tmp_path, name="image")
    try:
        for m in mounts:
            sh("mount", *[a for a in m if a is not None])
            done.append(m)
        assert sh("touch", str(rootfs / "usr/x"), check=False).returncode != 0  # read-only
        # The manifest's args, with a pool this machine has, metrics on a free port and the sim
        # device for the engine below.
        (ds_args,) = [c["args"] for n, _, c in containers
                      if n == "daemonset.yaml" and c["name"] == "kvcellard"]
        d.args = ["chroot", "--userspec=65532:2000", str(rootfs), *config["Entrypoint"], *ds_args,
                  "--set", "pool.capacity=64MiB", "--set", "http.address=127.0.0.1:0",
                  *DAEMON_ARGS]
        d.env = dict(os.environ, RUNTIME_DIRECTORY="/run/kvcellar")
        d.socket = str(run_dir / "kvcellard.sock")
        d.start()
        flags = dict(shm_mode="0666", **GEOMETRY)
        r = run_engine(d.socket, "backup", instance="image-writer", seed=9, tokens_seed=10,
                       pages=8, **flags)
        assert r.rc == EXIT_OK and r["stored"] == 8, r.describe()
        r = run_engine(d.socket, "load", instance="image-reader", verify_seed=9, tokens_seed=10,
                       pages=8, first_block=0, **flags)
        assert r.rc == EXIT_OK and r["hits"] == 8 and r["mismatched_bytes"] == 0, r.describe()
    finally:
        d.stop()
        for m in reversed(done):
            if m[-1] is not None:
                sh("umount", "-l", m[-1], check=False)
        if os.path.ismount(rootfs):
            sh("umount", "-l", str(rootfs), check=False)
        # Never remove the bundle while the host's /dev/shm is mounted inside it.
        mounted = [line.split()[1] for line in open("/proc/mounts")]
        if not any(m.startswith(str(bundle)) for m in mounted):
            shutil.rmtree(bundle, ignore_errors=True)
