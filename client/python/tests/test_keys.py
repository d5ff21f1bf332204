"""Page keys computed by the package against the golden vectors of docs/keys.md
(tests/data/keys_golden.json, written by an independent implementation)."""
import hashlib
import json

import numpy as np
import pytest
from conftest import GOLDEN_KEYS

from kvcellar import KvGroup, Namespace, page_keys

GOLDEN = json.loads(GOLDEN_KEYS.read_text())


def ns_of(spec):
    groups = tuple(KvGroup(g["kind"], g["window_tokens"]) for g in spec.get("groups", []))
    return Namespace(spec["model_id"], spec["model_revision"], spec["kv_dtype"],
                     spec["page_size"], layout=spec["layout"], tp_size=spec["tp_size"],
                     tenant=spec["tenant"], opaque_keys=spec["opaque_keys"], groups=groups)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_golden_chain(case):
    ns = ns_of(case["namespace"])
    assert ns.digest().hex() == case["ns_digest"]
    assert hashlib.sha256(bytes.fromhex(case["encoding_hex"])).hexdigest() == case["ns_digest"]
    keys = page_keys(ns, np.array(case["tokens"], dtype=np.uint32))
    assert [k.tobytes().hex() for k in keys] == case["page_keys"]


@pytest.mark.parametrize("case", GOLDEN["opaque_cases"], ids=lambda c: c["name"])
def test_golden_opaque_digest(case):
    assert ns_of(case["namespace"]).digest().hex() == case["ns_digest"]


def test_group_kind_is_checked():
    with pytest.raises(ValueError, match="KvGroup.kind"):
        KvGroup("linear")


def test_one_full_group_is_the_namespace_without_groups():
    plain = Namespace("m", "r", "bf16", 16)
    assert Namespace("m", "r", "bf16", 16, groups=(KvGroup("full"),)).digest() == plain.digest()
    hybrid = Namespace("m", "r", "bf16", 16, groups=(KvGroup("full"), KvGroup("window", 64)))
    assert hybrid.hybrid and hybrid.blocks_per_page == 2
    assert hybrid.digest() != plain.digest()
    # Other windows, group orders or kinds are other namespaces.
    assert Namespace("m", "r", "bf16", 16,
                     groups=(KvGroup("window", 64), KvGroup("full"))).digest() != hybrid.digest()
    assert Namespace("m", "r", "bf16", 16,
                     groups=(KvGroup("full"), KvGroup("window", 65))).digest() != hybrid.digest()


def test_chain_extension_and_partial_pages():
    ns = Namespace("m", "r", "bf16", 4)
    toks = np.arange(23, dtype=np.uint32)  # 5 full pages and 3 tokens
    full = page_keys(ns, toks)
    assert full.shape == (5, 32)
    ext = page_keys(ns, toks[8:], parent=full[1].tobytes())
    assert np.array_equal(ext, full[2:])
    assert page_keys(ns, toks[:3]).shape == (0, 32)
    # Tokens as a Python list or int64 array give the same keys.
    assert np.array_equal(page_keys(ns, list(range(23))), full)
    assert np.array_equal(page_keys(ns, toks.astype(np.int64)), full)


@pytest.mark.parametrize("kwargs,field", [
    (dict(kv_dtype="bf17"), "kv_dtype"),
    (dict(page_size=0), "page_size"),
    (dict(tp_size=0), "tp_size"),
    (dict(model_id=""), "model_id"),
    (dict(layout="mqa"), "layout"),
    (dict(tenant="a\nb"), "tenant"),
    (dict(groups=(KvGroup("full"), KvGroup("window"))), r"groups\[1\].window_tokens"),
    (dict(groups=(KvGroup("full"), KvGroup("state", 7))), r"groups\[1\].window_tokens"),
    (dict(groups=(KvGroup("full"),) * 17), "groups"),
    (dict(groups=("full",)), r"groups\[0\]"),
])
def test_bad_namespace_names_the_field(kwargs, field):
    args = dict(model_id="m", model_revision="r", kv_dtype="bf16", page_size=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        Namespace(**args)


def test_bad_tokens():
    ns = Namespace("m", "r", "bf16", 4)
    with pytest.raises(ValueError, match="tokens"):
        page_keys(ns, np.array([-1, 2, 3, 4]))
    with pytest.raises(ValueError, match="tokens"):
        page_keys(ns, np.zeros((2, 4)))
    with pytest.raises(ValueError, match="parent"):
        page_keys(ns, np.arange(4), parent=b"short")
