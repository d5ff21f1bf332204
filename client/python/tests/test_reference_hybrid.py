"""The reference engine (kvcellar/reference.py) on a hybrid model: a random-weight Gemma 3 text
model whose layers alternate a 64-token sliding window and full attention, in a hybrid namespace
of two KV groups (full, window) against a real kvcellard on the sim device, at TP 1 and 2.

Request A (8 full pages, ending on a page boundary) backs up every full-attention object and the
window objects of the boundaries a later hit can use: 8 (a prompt going on from A) and 7 (A
again: its last token is always computed). Request B goes on from A: it loads A's 8 full pages
and only the last 4 window pages (the 63 tokens a sliding layer keeps), prefills its suffix and
decodes greedily. Its tokens must be those of a full prefill, its logits equal within
LOGIT_ATOL, the KV it loaded bit-for-bit A's recomputed, and the bytes the daemon moved exactly
those objects (its kvcellar_moved_bytes_total). A prompt that leaves A part way misses (its
boundary's window was not stored), a daemon killed before B is a miss (the same tokens), and a
namespace without the model's groups is refused at construction.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kvcellar.keys import KvGroup, Namespace  # noqa: E402
from kvcellar.reference import ReferenceEngine, make_gemma3, namespace_for  # noqa: E402
from reference_util import engine_for as reference_engine_for  # noqa: E402
from reference_util import (killed_daemon_is_a_miss, moved, poison,  # noqa: E402
                            same_as_prefill)

P = 16
W = 64  # the sliding window: the token and the 63 before it
WINDOW_PAGES = -(-(W - 1) // P)  # 4: the pages a hit needs of the window group
A_PAGES = 8  # A: 128 tokens, a page boundary
B_SUFFIX = 2 * P + 7  # B: A's 8 pages, 2 of its own and a partial one
NEW_TOKENS = 8
NUM_BLOCKS = 64
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 32
# One (page, group) object over all TP shards: the group's 2 layers, K and V, 16 tokens x
# 2 KV heads x 32 float32 (each of T ranks stores 1 / T of it).
OBJECT_BYTES = (LAYERS // 2) * 2 * P * KV_HEADS * HEAD_DIM * 4
# float32 on CPU, logits up to ~30; cached and uncached runs measure ~1e-5 here (the window
# layers' attention sums over fewer masked keys in the cached run).
LOGIT_ATOL = 1e-4
MARGIN_OVER_ATOL = 100  # greedy tokens cannot flip: top1 - top2 >= 100 x LOGIT_ATOL (0.33 here)
FULL, WINDOW = 0, 1  # the namespace's groups, in KvGeometry.groups' order


@pytest.fixture(scope="module")
def model():
    return make_gemma3(seed=0, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       sliding_window=W)


def prompts(vocab):
    rng = np.random.default_rng(0)
    a = rng.integers(0, vocab, A_PAGES * P)
    b = np.concatenate([a, rng.integers(0, vocab, B_SUFFIX)])
    return a, b


def engine_for(model, tp, daemon, name):
    assert namespace_for(model).groups == (KvGroup("full"), KvGroup("window", W))
    return reference_engine_for(model, tp, daemon, name, page_size=P, num_blocks=NUM_BLOCKS)


class Moves:
    """Bytes the daemon moved since the last call, each way."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.h2d, self.d2h = moved(daemon, "h2d"), moved(daemon, "d2h")

    def since(self):
        h2d, d2h = moved(self.daemon, "h2d"), moved(self.daemon, "d2h")
        out = (h2d - self.h2d, d2h - self.d2h)
        self.h2d, self.d2h = h2d, d2h
        return out


@pytest.mark.parametrize("tp", [1, 2])
def test_window_pages_reproduce_the_prefill(tp, model, daemon):
    a, b = prompts(model.config.vocab_size)
    with engine_for(model, tp, daemon, f"hybrid-tp{tp}") as engine:
        windows = engine.geo.windows
        assert windows == (W, 0, W, 0)
        assert engine.geo.layer_groups == [WINDOW, FULL, WINDOW, FULL]
        moves = Moves(daemon)
        ra = engine.generate(a, NEW_TOKENS)
        assert (ra.hit_pages, ra.backed_up_pages, ra.miss_reason) == (0, A_PAGES, "")
        # Every full object, and the window pages of boundaries 8 and 7: pages 3 to 7.
        stored_a = A_PAGES + WINDOW_PAGES + 1
        assert moves.since() == (0, stored_a * OBJECT_BYTES)

        poison(engine)
        rb = engine.generate(b, NEW_TOKENS, keep_kv=True)
        assert rb.miss_reason == ""
        assert rb.hit_pages == rb.matched_pages == A_PAGES
        assert rb.prefill_tokens == len(b) - A_PAGES * P
        assert rb.backed_up_pages == len(b) // P - A_PAGES
        # Loaded: A's 8 full objects and the window's last 4 (pages 4 to 7). Stored: pages 8
        # and 9 of both groups (both lie in the window of boundary 10, B's end and its cap).
        assert moves.since() == ((A_PAGES + WINDOW_PAGES) * OBJECT_BYTES, 4 * OBJECT_BYTES)

        full = engine.generate(b, NEW_TOKENS, use_cache=False)
        assert full.hit_pages == 0 and full.prefill_tokens == len(b)
        logit_diff, margin = same_as_prefill(rb, full, LOGIT_ATOL, MARGIN_OVER_ATOL)

        # The loaded bytes are A's prefill's, bit for bit: a full layer's every page, a window
        # layer's last 4 before the boundary.
        again = engine.generate(a, 1, use_cache=False, keep_kv=True)
        hp = A_PAGES * P
        for (k, v), (ka, va), window in zip(rb.loaded_kv, again.prefill_kv, windows):
            first = hp - WINDOW_PAGES * P if window else 0
            assert k.shape[-2] == hp - first
            assert torch.equal(k, ka[:, first:hp]) and torch.equal(v, va[:, first:hp])
        moves.since()
        print(f"tp={tp} logit_max_abs_diff={logit_diff:.3g} min_top1_top2_margin={margin:.3g} "
              f"a_stored_objects={stored_a} of {2 * A_PAGES} "
              f"b_loaded_objects={A_PAGES + WINDOW_PAGES} of {2 * A_PAGES}")

        # A again hits at its cap, boundary 7: the window page 3 A stored for it is loaded.
        ra2 = engine.generate(a, NEW_TOKENS)
        assert (ra2.hit_pages, ra2.miss_reason) == (A_PAGES - 1, "")
        assert ra2.tokens == ra.tokens
        assert moves.since() == ((A_PAGES - 1 + WINDOW_PAGES) * OBJECT_BYTES, 0)
        # B's own pages were backed up: all its full pages hit now.
        rb2 = engine.generate(b, NEW_TOKENS)
        assert rb2.hit_pages == len(b) // P and rb2.tokens == full.tokens
        assert len(engine.blocks.free) == NUM_BLOCKS  # every op settled, every block back


def test_a_prompt_leaving_the_prefix_part_way_misses(model, daemon):
    # C shares A's first 5 pages. A stored the window pages of its own boundaries only (3 to 7),
    # not those boundary 5 needs (1 to 4): no boundary of C is served, C is a full prefill, and
    # its backup stores its own boundary's window, which C again then hits.
    a, _ = prompts(model.config.vocab_size)
    rng = np.random.default_rng(7)
    c = np.concatenate([a[:5 * P], rng.integers(0, model.config.vocab_size, 3 * P + 2)])
    with engine_for(model, 1, daemon, "hybrid-part-way") as engine:
        assert engine.generate(a, 1).backed_up_pages == A_PAGES
        expect = engine.generate(c, NEW_TOKENS, use_cache=False).tokens
        moves = Moves(daemon)
        rc = engine.generate(c, NEW_TOKENS)
        assert (rc.hit_pages, rc.matched_pages, rc.miss_reason) == (0, 0, "")
        assert rc.tokens == expect and rc.backed_up_pages == len(c) // P
        # Pages 0 to 4 were A's. C's new pages 5 to 7 are stored in both groups; the window of
        # its boundary 8 also holds page 4, whose window object A stored for its boundary 8.
        assert moves.since() == (0, 3 * 2 * OBJECT_BYTES)
        poison(engine)
        rc2 = engine.generate(c, NEW_TOKENS)
        assert rc2.hit_pages == len(c) // P and rc2.tokens == expect


@pytest.mark.parametrize("tp", [1, 2])
def test_daemon_killed_before_b_is_a_miss(tp, model, daemon):
    a, b = prompts(model.config.vocab_size)
    with engine_for(model, tp, daemon, f"hybrid-kill-tp{tp}") as engine:
        killed_daemon_is_a_miss(engine, daemon, a, b, NEW_TOKENS, A_PAGES, NUM_BLOCKS)


def test_a_namespace_without_the_models_groups_is_refused(model):
    ns = namespace_for(model, page_size=P)
    flat = Namespace(ns.model_id, ns.model_revision, ns.kv_dtype, P, layout="gqa")
    with pytest.raises(ValueError, match="ns.groups"):
        ReferenceEngine(model, None, flat)
