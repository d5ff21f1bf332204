"""The reference engine (kvcellar/reference.py) on real transformers models with random weights,
against a real kvcellard on the sim device: GQA at TP 1 and 2, and MLA.

Request A prefills a prompt and backs up its full pages; request B shares A's full pages and
adds its own suffix: it loads the cached pages layer by layer, prefills only its suffix and
decodes greedily. Its tokens must be those of a full prefill, its logits equal within
LOGIT_ATOL, and the KV it loaded bit-for-bit the KV of A's prompt recomputed without the cache
(the same computation, deterministic on CPU). A daemon killed before B, or between B's Match
and its Load, is a miss: the same tokens, nothing raised.
"""
import signal

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kvcellar.reference import make_deepseek_mla, make_llama  # noqa: E402
from reference_util import engine_for as reference_engine_for  # noqa: E402
from reference_util import killed_daemon_is_a_miss, poison, same_as_prefill  # noqa: E402

P = 16
PREFIX_PAGES = 6  # A: 6 full pages and a partial one
A_TAIL = 5
B_SUFFIX = 2 * P + 7  # B: A's 6 full pages, 2 of its own and a partial one
NEW_TOKENS = 8
NUM_BLOCKS = 48
# float32 on CPU, logits up to ~30. Cached and uncached runs measure 0.0 here (CPU kernels
# compute each row alike whatever the number of rows); the bound leaves room for other BLAS.
LOGIT_ATOL = 1e-4
KV_ATOL = 1e-4  # B's prefix KV from A's prefill vs from B's own full prefill (informative)
MARGIN_OVER_ATOL = 100  # greedy tokens cannot flip: top1 - top2 >= 100 x LOGIT_ATOL

# case: (model, TP ranks, prompt seed). Seeds chosen so that B's decode has top1-top2 margins
# of 0.29 (GQA) and 0.81 (MLA), far above LOGIT_ATOL.
CASES = {"gqa-tp1": ("llama", 1, 0), "gqa-tp2": ("llama", 2, 0), "mla": ("mla", 1, 1)}


@pytest.fixture(scope="module")
def models():
    return {"llama": make_llama(seed=0), "mla": make_deepseek_mla(seed=0)}


def prompts(seed, vocab):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, vocab, PREFIX_PAGES * P + A_TAIL)
    b = np.concatenate([a[:PREFIX_PAGES * P], rng.integers(0, vocab, B_SUFFIX)])
    return a, b


def engine_for(model, tp, daemon, name):
    return reference_engine_for(model, tp, daemon, name, page_size=P, num_blocks=NUM_BLOCKS)


def max_diff(pairs):
    return max(float((x - y).abs().max()) for x, y in pairs)


@pytest.mark.parametrize("case", CASES)
def test_prefix_pages_reproduce_the_prefill(case, models, daemon):
    kind, tp, seed = CASES[case]
    model = models[kind]
    a, b = prompts(seed, model.config.vocab_size)
    hp = PREFIX_PAGES * P
    with engine_for(model, tp, daemon, f"ref-{case}") as engine:
        ra = engine.generate(a, NEW_TOKENS)
        assert (ra.hit_pages, ra.backed_up_pages, ra.miss_reason) == (0, PREFIX_PAGES, "")

        poison(engine)
        rb = engine.generate(b, NEW_TOKENS, keep_kv=True)
        assert rb.miss_reason == ""
        assert rb.hit_pages == rb.matched_pages == PREFIX_PAGES  # A's full pages
        assert rb.prefill_tokens == len(b) - hp
        assert rb.backed_up_pages == len(b) // P - PREFIX_PAGES

        full = engine.generate(b, NEW_TOKENS, use_cache=False, keep_kv=True)
        assert full.hit_pages == 0 and full.prefill_tokens == len(b)
        logit_diff, margin = same_as_prefill(rb, full, LOGIT_ATOL, MARGIN_OVER_ATOL)

        # The loaded bytes are A's prefill's, bit for bit.
        again = engine.generate(a, 1, use_cache=False, keep_kv=True)
        assert len(rb.loaded_kv) == model.config.num_hidden_layers
        for (k, v), (ka, va) in zip(rb.loaded_kv, again.prefill_kv):
            assert k.shape[-2] == hp
            assert torch.equal(k, ka[:, :hp]) and torch.equal(v, va[:, :hp])
        # Against B's own full prefill: the same values up to the computation's rounding.
        kv_diff = max_diff([(k, kb[:, :hp]) for (k, _), (kb, _) in
                            zip(rb.loaded_kv, full.prefill_kv)] +
                           [(v, vb[:, :hp]) for (_, v), (_, vb) in
                            zip(rb.loaded_kv, full.prefill_kv)])
        assert kv_diff <= KV_ATOL
        print(f"case={case} logit_max_abs_diff={logit_diff:.3g} kv_max_abs_diff={kv_diff:.3g} "
              f"min_top1_top2_margin={margin:.3g}")

        # B's own pages were backed up: all its full pages hit now.
        rb2 = engine.generate(b, NEW_TOKENS)
        assert rb2.hit_pages == len(b) // P and rb2.tokens == full.tokens
        assert len(engine.blocks.free) == NUM_BLOCKS  # every op settled, every block back


@pytest.mark.parametrize("case", CASES)
def test_daemon_killed_before_b_is_a_miss(case, models, daemon):
    kind, tp, seed = CASES[case]
    model = models[kind]
    a, b = prompts(seed, model.config.vocab_size)
    with engine_for(model, tp, daemon, f"kill-{case}") as engine:
        killed_daemon_is_a_miss(engine, daemon, a, b, NEW_TOKENS, PREFIX_PAGES, NUM_BLOCKS)


def test_daemon_killed_between_match_and_load_is_a_miss(models, daemon):
    model = models["llama"]
    a, b = prompts(0, model.config.vocab_size)
    with engine_for(model, 2, daemon, "kill-load") as engine:
        assert engine.generate(a, NEW_TOKENS).backed_up_pages == PREFIX_PAGES
        expect = engine.generate(b, NEW_TOKENS, use_cache=False).tokens
        poison(engine)
        rank0 = engine.sessions[0]
        load = rank0.load

        def kill_then_load(*args, **kwargs):
            daemon.stop(signal.SIGKILL)
            return load(*args, **kwargs)

        rank0.load = kill_then_load
        rb = engine.generate(b, NEW_TOKENS)
        assert rb.tokens == expect  # recomputed: nothing of the NaN blocks was used
        assert rb.hit_pages == 0 and rb.matched_pages == PREFIX_PAGES
        assert rb.miss_reason.startswith("load:"), rb.miss_reason
        # Blocks of Loads whose outcome the client does not know yet are set aside, not reused.
        assert len(engine.blocks.free) + engine.blocks.num_deferred == NUM_BLOCKS
        assert engine.generate(b, NEW_TOKENS).tokens == expect
