"""The room map of docs/architecture.md, checked against the tree's #include lines.

Each rule says which folders a folder may include from; a new include that breaks one (a room
reaching up, core calling the OS, gRPC outside the RPC room) fails here with the file and line.

Interpreter: Debian's /usr/bin/python3 (pytest); reads source files only.
"""
import os
import re

import pytest

SOURCE_DIR = os.environ.get(
    "KVCELLAR_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)

# server/ rooms, top to bottom: a room may include the rooms after it in this list, plus the
# rooms every room may use.
SERVER_ORDER = ["root", "rpc", "cache", "admin", "datapath", "l3", "l2", "session", "events"]
SERVER_SHARED = ["errors", "config", "metrics"]
# What the shared rooms themselves may include.
SHARED_DEPS = {"errors": [], "config": [], "metrics": []}

# Top-level layers and the project folders each may include.
LAYER_DEPS = {
    "core": ["core"],
    "platform": ["platform", "core"],
    "gpu": ["gpu", "core", "platform"],
    "storage": ["storage", "core", "platform"],
    "client": ["client", "core", "platform"],
}
PROJECT_ROOTS = {"core", "platform", "gpu", "storage", "server", "client", "proto", "kvcellar",
                 "tests"}

# System headers that mean an OS call: core/ is pure bookkeeping.
OS_HEADERS = {"unistd.h", "fcntl.h", "sys/mman.h", "sys/stat.h", "sys/statvfs.h", "sys/file.h",
              "sys/types.h", "sys/socket.h", "sys/un.h", "dirent.h", "signal.h", "fstream"}


def sources(folder):
    root = os.path.join(SOURCE_DIR, folder)
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            if name.endswith((".h", ".cc", ".cu")):
                yield os.path.join(dirpath, name)


def includes(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for m in INCLUDE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        yield line, m.group(1)


def rel(path):
    return os.path.relpath(path, SOURCE_DIR)


def server_room(path_in_repo):
    parts = path_in_repo.split("/")
    if parts[0] != "server":
        return None
    return parts[1] if len(parts) > 2 else "root"


def test_server_rooms_exist_as_documented():
    rooms = {d for d in os.listdir(os.path.join(SOURCE_DIR, "server"))
             if os.path.isdir(os.path.join(SOURCE_DIR, "server", d))}
    assert rooms == set(SERVER_ORDER[1:]) | set(SERVER_SHARED)
    with open(os.path.join(SOURCE_DIR, "docs", "architecture.md"), encoding="utf-8") as f:
        doc = f.read()
    for room in rooms:
        assert f"`{room}/`" in doc, f"docs/architecture.md does not describe server/{room}/"


def test_server_rooms_depend_downward_only():
    allowed = {}
    for i, room in enumerate(SERVER_ORDER):
        allowed[room] = set(SERVER_ORDER[i:]) | set(SERVER_SHARED)
    for room, deps in SHARED_DEPS.items():
        allowed[room] = {room, *deps}
    bad = []
    for path in sources("server"):
        room = server_room(rel(path))
        for line, inc in includes(path):
            target = server_room(inc)
            if target is None or inc == "server/build_info.h":
                continue
            if target not in allowed[room]:
                bad.append(f"{rel(path)}:{line}: {room}/ includes {inc} ({target}/)")
    assert not bad, "rooms reaching up or sideways:\n" + "\n".join(bad)


def test_grpc_only_in_the_rpc_room_and_the_shell():
    bad = []
    for path in sources("server"):
        room = server_room(rel(path))
        if room in ("rpc", "root"):
            continue
        for line, inc in includes(path):
            if inc.startswith("grpcpp/") or inc.startswith("grpc/") or inc.endswith(".grpc.pb.h"):
                bad.append(f"{rel(path)}:{line}: {inc}")
    assert not bad, "gRPC outside server/rpc/ and the process shell:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", sorted(LAYER_DEPS))
def test_layers_depend_downward_only(layer):
    bad = []
    for path in sources(layer):
        for line, inc in includes(path):
            top = inc.split("/")[0]
            if "/" not in inc or top not in PROJECT_ROOTS:
                continue  # A system or third-party header.
            if top == "kvcellar" and layer in ("client",):
                continue  # Generated proto headers: the client speaks the API.
            if top not in LAYER_DEPS[layer]:
                bad.append(f"{rel(path)}:{line}: {inc}")
    assert not bad, f"{layer}/ includes what it may not:\n" + "\n".join(bad)


def test_core_makes_no_os_calls():
    bad = []
    for path in sources("core"):
        for line, inc in includes(path):
            if inc in OS_HEADERS:
                bad.append(f"{rel(path)}:{line}: {inc}")
    assert not bad, "core/ is pure bookkeeping; OS calls belong in platform/:\n" + "\n".join(bad)
