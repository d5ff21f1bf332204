"""What the reference engine's tests (test_reference_model.py, test_reference_hybrid.py) share:
an engine on a real daemon, a poisoned pool, greedy margins, the daemon's moved bytes."""
import re
import signal
import urllib.request
from contextlib import contextmanager

from kvcellar import Client
from kvcellar.reference import ReferenceEngine, namespace_for


@contextmanager
def engine_for(model, tp, daemon, name, *, page_size, num_blocks):
    """A ReferenceEngine of ``tp`` ranks on ``daemon``: every TP rank is a session of this one
    process (the model runs once, each rank's pool holds its share of the KV heads)."""
    client = Client(daemon.socket, rpc_timeout_ms=250, register_timeout_ms=500,
                    backoff_max_ms=200)
    ns = namespace_for(model, page_size=page_size, tp_size=tp, model_id=name)
    engine = ReferenceEngine(model, client, ns, name, rank_count=tp, num_blocks=num_blocks)
    try:
        assert engine.wait_active(5000)
        yield engine
    finally:
        engine.close()
        client.close()


def poison(engine):
    """NaN in every block: what a request uses from the pool can only come from a Load."""
    for per_layer in engine.pool.tensors:
        for t in per_layer:
            t.fill_(float("nan"))


def min_margin(logits):
    """The smallest top-1 minus top-2 logit over the steps: greedy tokens cannot flip below it."""
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def same_as_prefill(cached, full, logit_atol, margin_over_atol):
    """Asserts that ``cached`` (a run on loaded pages) gave ``full``'s tokens (a full prefill's)
    and its logits within ``logit_atol``, and that no greedy token was near a tie (top1 - top2 at
    least ``margin_over_atol`` x ``logit_atol``: equal tokens are no luck of rounding). Returns
    (the largest logit difference, the smallest margin)."""
    assert cached.tokens == full.tokens
    logit_diff = float((cached.logits - full.logits).abs().max())
    margin = min_margin(full.logits)
    assert logit_diff <= logit_atol
    assert margin >= margin_over_atol * logit_atol
    return logit_diff, margin


def killed_daemon_is_a_miss(engine, daemon, a, b, new_tokens, a_pages, num_blocks):
    """Request A backs up its ``a_pages``; the daemon is SIGKILLed; request B (which shares A's
    pages) then gets a full prefill's tokens, no hit, a reason, no backup, every block back."""
    assert engine.generate(a, new_tokens).backed_up_pages == a_pages
    expect = engine.generate(b, new_tokens, use_cache=False).tokens
    daemon.stop(signal.SIGKILL)
    rb = engine.generate(b, new_tokens)
    assert rb.tokens == expect
    assert rb.hit_pages == 0 and rb.prefill_tokens == len(b)
    assert rb.miss_reason.startswith("match:"), rb.miss_reason
    assert rb.backed_up_pages == 0
    assert len(engine.blocks.free) + engine.blocks.num_deferred == num_blocks


def moved(daemon, direction):
    """kvcellar_moved_bytes_total{direction=...}: h2d are Loads, d2h Backups."""
    text = urllib.request.urlopen(f"http://{daemon.http}/metrics", timeout=10).read().decode()
    m = re.search(rf'^kvcellar_moved_bytes_total{{direction="{direction}"}} (\S+)$', text,
                  re.MULTILINE)
    return int(float(m.group(1))) if m else 0
