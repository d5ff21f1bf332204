"""NVIDIA Dynamo's own KV indexer (ai-dynamo-runtime 1.6.1, dynamo_indexer.py) subscribed to a
kvcellard: what it answers for a prompt follows what the node's Match finds, through backups, L2
eviction, L3 removal, an admin Clear, a warm restart (SIGTERM: the pool kept, its pages announced
with their tokens from the label log), a cold L2 over a kept L3 tier (SIGKILL, the tier's scan)
and a cold restart with nothing kept.

Runs in .venv-vllm with the other vLLM-format event tests (the engine is test_vllm_kv_events's,
on the sim device, backing pages up with their tokens); the indexer process runs from
.venv-dynamo. The 3-node routing with Dynamo's answers is in test_vllm_kv_events.py.

Each change is followed within BOUND_S (the indexer's answer polled every 10 ms); the largest wait
is printed as ``dynamo: follows within X s``.
"""
import os
import signal
import subprocess
import uuid

import numpy as np

from conftest import bin_path
from dynamo_indexer import DynamoIndexer, free_port
from kvcellar import Namespace, page_keys
from test_vllm_kv_events import P, Engine

BOUND_S = 3.0  # what a router may lag behind the node: a restart is seen at the next heartbeat (1 s)
MODEL = "test-org/dynamo-model"
WORKER = 1


def ctl(d, *args):
    out = subprocess.run([bin_path("kvcellarctl"), "--addr", d.admin_socket, *args],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dynamo_indexer_follows_one_node(daemon_factory, tmp_path):
    port, replay = free_port(), free_port()
    shm = f"kvc-dyn-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    args = ["--set", f"events.endpoint=tcp://*:{port}",
            "--set", f"events.replay_endpoint=tcp://*:{replay}",
            "--set", f"storage.tiers=file:{tmp_path}/l3?name=nvme",
            "--set", "storage.write_policy=write_through",
            "--set", f"pool.shm_name={shm}", "--set", "pool.capacity=64MiB",
            "--set", "events.node=node-a"]
    d = daemon_factory(args=args, name="dyn")
    ns = Namespace(MODEL, "r1", "int8", P)
    ix = DynamoIndexer({WORKER: (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")}, P,
                       MODEL, tmp_path / "indexer.log")
    eng = None
    waits = []

    def follows(tokens, want, tier="longest_matched"):
        waits.append(ix.wait_blocks(WORKER, tokens, P, want, tier, timeout=BOUND_S))

    def match(keys):
        m = eng.session.match([keys], by_keys=True, prefetch="none")  # a look, not a fetch
        assert m.ok, m.reason
        return m.results[0].l2_hit_pages, m.results[0].l3_hit_pages

    try:
        eng = Engine(d.socket, ns, "dyn-engine")
        # Prompt A: six pages; B shares A's first two pages, then two of its own.
        a_tok = np.random.default_rng(11).integers(0, 32000, 6 * P).astype(np.uint32)
        b_tok = np.concatenate([a_tok[:2 * P], np.random.default_rng(12).integers(0, 32000, 2 * P)
                                ]).astype(np.uint32)
        a, b = page_keys(ns, a_tok), page_keys(ns, b_tok)
        assert eng.backup(a, 0, tokens=a_tok) == 6
        assert eng.backup(b[2:], 6, parent=bytes(b[1]), tokens=b_tok[2 * P:]) == 2
        assert match(a) == (6, 0) and match(b) == (4, 0)
        follows(a_tok, 6)
        follows(b_tok, 4)
        assert ix.blocks(WORKER, a_tok, P, "cpu") == 6  # L2 is its host_pinned tier

        # Out of L2, still in the node's L3 tier: Dynamo's cpu answer drops, its disk one stays.
        ctl(d, "evict", "--tier", "l2")
        assert match(a) == (0, 6)
        follows(a_tok, 0, "cpu")
        assert ix.blocks(WORKER, a_tok, P, "disk") == 6

        # Out of L3 too: nothing left.
        ctl(d, "clear", "--tier", "l3", "--yes")
        assert match(a) == (0, 0)
        follows(a_tok, 0)
        follows(b_tok, 0)

        # Backed up again, then an admin Clear of everything.
        assert eng.backup(a, 0, tokens=a_tok) == 6
        follows(a_tok, 6)
        ctl(d, "clear", "--yes")
        assert match(a) == (0, 0)
        follows(a_tok, 0)

        def restart(sig, keep_pool=True, keep_l3=True):
            nonlocal d, eng
            eng.close()
            eng = None
            d.proc.send_signal(sig)
            d.proc.wait(30)
            if not keep_l3:
                subprocess.run(["rm", "-rf", str(tmp_path / "l3")], check=True)
            # The label log (/dev/shm/<shm>.labels) stays unless the node rebooted.
            for name in [d.socket, d.admin_socket] + (
                    [] if keep_pool else [f"/dev/shm/{shm}", f"/dev/shm/{shm}.journal"]):
                if os.path.exists(name):
                    os.unlink(name)
            d = daemon_factory(args=args, name="dyn")
            eng = Engine(d.socket, ns, f"dyn-engine-{len(waits)}")

        # A warm restart (SIGTERM, as an upgrade does): the pool comes back with its pages, and
        # their stored events carry their tokens again (events.label_log), so Dynamo counts them.
        assert eng.backup(a, 0, tokens=a_tok) == 6
        follows(a_tok, 6)
        restart(signal.SIGTERM)
        assert match(a) == (6, 0)
        # The indexer has the new daemon's first batches (AllBlocksCleared and the recovered
        # pages) once it has a page stored after them: only then does its answer for A speak
        # for the restarted node.
        c_tok = np.random.default_rng(13).integers(0, 32000, 2 * P).astype(np.uint32)
        assert eng.backup(page_keys(ns, c_tok), 0, tokens=c_tok) == 2
        follows(c_tok, 2)
        follows(a_tok, 6, "cpu")

        # A cold L2 (SIGKILL, the pool's shm objects gone) over the same L3 tier: its scan puts the
        # pages back as L3 hits, announced as the node's STORAGE with their tokens.
        restart(signal.SIGKILL, keep_pool=False)
        assert match(a) == (0, 6)
        follows(a_tok, 0, "cpu")  # The new daemon's AllBlocksCleared, then the scan's pages.
        follows(a_tok, 6, "disk")
        assert ix.blocks(WORKER, a_tok, P) == 6

        # A cold restart with nothing kept (SIGKILL; the L3 tier's files go with the node): the
        # new daemon's first batch is AllBlocksCleared, and what it stores next is indexed.
        ctl(d, "clear", "--yes")
        follows(a_tok, 0)
        assert eng.backup(a[:3], 0, tokens=a_tok[:3 * P]) == 3
        follows(a_tok, 3)
        restart(signal.SIGKILL, keep_pool=False, keep_l3=False)
        assert match(a) == (0, 0)
        follows(a_tok, 0)
        assert eng.backup(a, 0, tokens=a_tok) == 6
        assert match(a) == (6, 0)
        follows(a_tok, 6)
        print(f"dynamo: follows within {max(waits):.3f} s (bound {BOUND_S} s, {len(waits)} "
              f"changes)")
    finally:
        if eng is not None:
            eng.close()
        ix.close()
        for suffix in ("", ".journal", ".labels"):
            if os.path.exists(f"/dev/shm/{shm}{suffix}"):
                os.unlink(f"/dev/shm/{shm}{suffix}")
