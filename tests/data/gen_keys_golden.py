#!/usr/bin/python3
"""Writes tests/data/keys_golden.json: golden vectors for kvcellar namespace digests and page keys.

This is a second, independent implementation of docs/keys.md in the Python standard library
(hashlib, struct), so a drift in the C++ encoding fails tests/core/page_key_test.cc. Regenerate
only when the spec itself changes (which takes a new encoding tag):

    /usr/bin/python3 tests/data/gen_keys_golden.py
"""

import hashlib
import json
import os
import struct

TAG = b"kvcellar-ns-v2"
# A hybrid model's namespace: v2's fields, then its KV groups.
HYBRID_TAG = b"kvcellar-ns-v3"
LAYOUTS = {"mha": 0, "mla": 1}
GROUP_KINDS = {"full": 0, "window": 1, "state": 2}


def lp(b: bytes) -> bytes:
    """A length-prefixed field: u32 little-endian length, then the bytes."""
    return struct.pack("<I", len(b)) + b


def hybrid(ns: dict) -> bool:
    groups = ns.get("groups", [])
    return len(groups) > 1 or (len(groups) == 1 and groups[0]["kind"] != "full")


def ns_encoding(ns: dict) -> bytes:
    shards = 1 if ns["layout"] == "mla" else ns["tp_size"]
    enc = (lp(HYBRID_TAG if hybrid(ns) else TAG) + lp(ns["tenant"].encode()) +
           lp(ns["model_id"].encode()) + lp(ns["model_revision"].encode()) +
           lp(ns["kv_dtype"].encode()) +
           struct.pack("<IIII", ns["page_size"], LAYOUTS[ns["layout"]], shards,
                       1 if ns["opaque_keys"] else 0))
    if hybrid(ns):
        enc += struct.pack("<I", len(ns["groups"]))
        for g in ns["groups"]:
            enc += struct.pack("<II", GROUP_KINDS[g["kind"]], g.get("window_tokens", 0))
    return enc


def page_keys(parent: bytes, tokens: list, page_size: int) -> list:
    keys = []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size:(i + 1) * page_size]
        parent = hashlib.sha256(struct.pack("<%dI" % page_size, *page) + parent).digest()
        keys.append(parent)
    return keys


def lcg_tokens(n: int, seed: int, vocab: int) -> list:
    """Deterministic pseudo-random token ids in [0, vocab)."""
    out, x = [], seed
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((x >> 33) % vocab)
    return out


def ns(tenant, model_id, revision, dtype, page_size, layout, tp, opaque=False, groups=None):
    spec = {"tenant": tenant, "model_id": model_id, "model_revision": revision,
            "kv_dtype": dtype, "page_size": page_size, "layout": layout, "tp_size": tp,
            "opaque_keys": opaque}
    if groups is not None:
        spec["groups"] = [{"kind": k, "window_tokens": w} for k, w in groups]
    return spec


LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_REV = "0e9e39f249a16976918f6564b8830bc894c89659"
DEEPSEEK = "deepseek-ai/DeepSeek-V3"
DEEPSEEK_REV = "sha256:7f3c1a0d9e2b4c5a"

CASES = [
    # The worked example of docs/keys.md: two full pages of 4 and a partial one.
    ("docs_example", ns("acme", "tiny-llm", "rev1", "bf16", 4, "mha", 1), list(range(1, 11))),
    ("mha_tp2_p16_partial", ns("acme", LLAMA, LLAMA_REV, "bf16", 16, "mha", 2),
     lcg_tokens(16 * 5 + 7, seed=1, vocab=128256)),
    ("mha_tp1_p16_exact", ns("", LLAMA, LLAMA_REV, "fp8_e4m3", 16, "mha", 1),
     lcg_tokens(16 * 4, seed=2, vocab=128256)),
    ("mla_tp8_p64", ns("team-b", DEEPSEEK, DEEPSEEK_REV, "fp8_e4m3", 64, "mla", 8),
     lcg_tokens(64 * 3 + 63, seed=3, vocab=129280)),
    # MLA stores one shard whatever the TP size, so TP 4 shares TP 8's digest and keys.
    ("mla_tp4_p64_same_as_tp8", ns("team-b", DEEPSEEK, DEEPSEEK_REV, "fp8_e4m3", 64, "mla", 4),
     lcg_tokens(64 * 3 + 63, seed=3, vocab=129280)),
    ("p1_every_token_a_page", ns("acme", "tiny-llm", "rev1", "fp16", 1, "mha", 4),
     [0, 1, 2, 3, 4, 5, 4294967295]),
    ("large_ids_p16", ns("acme", "tiny-llm", "rev2", "fp32", 16, "mha", 1),
     [4294967295 - i for i in range(24)] + [2147483648, 2147483647, 65535, 65536, 0, 1, 255,
                                            256] + [4294967294] * 8),
    ("shorter_than_a_page", ns("acme", "tiny-llm", "rev1", "bf16", 16, "mha", 1),
     list(range(15))),
    ("no_tokens", ns("acme", "tiny-llm", "rev1", "bf16", 16, "mha", 1), []),
    ("utf8_tenant_p256", ns("équipe-δ", "Qwen/Qwen2.5-7B", "a09a3545", "int8", 256, "mha", 2),
     lcg_tokens(256 * 2 + 100, seed=4, vocab=152064)),
    # Hybrid models (kvcellar-ns-v3): sliding window beside full attention (Gemma 3 style) ...
    ("hybrid_window_p32", ns("acme", "google/gemma-3-1b-it", "9b0cc0d", "bf16", 32, "mha", 1,
                             groups=[("full", 0), ("window", 512)]),
     lcg_tokens(32 * 3 + 5, seed=5, vocab=262144)),
    # ... and Gated DeltaNet state groups beside full attention (Qwen3.5 style), TP 2.
    ("hybrid_state_tp2_p64", ns("", "Qwen/Qwen3.5-9B", "c1d2e3f", "bf16", 64, "mha", 2,
                                groups=[("full", 0), ("state", 0), ("state", 0), ("state", 0)]),
     lcg_tokens(64 * 2, seed=6, vocab=151936)),
    # One full-attention group is not hybrid: the v2 encoding of the docs example, same keys.
    ("one_full_group_is_v2", ns("acme", "tiny-llm", "rev1", "bf16", 4, "mha", 1,
                                groups=[("full", 0)]), list(range(1, 11))),
]

# Opaque namespaces: the engine sends its own keys; the daemon indexes SHA-256(ns_digest || key).
OPAQUE_CASES = [
    # Same fields as mha_tp2_p16_partial but opaque: a different digest.
    ("opaque_mha_tp2", ns("acme", LLAMA, LLAMA_REV, "bf16", 16, "mha", 2, opaque=True),
     [hashlib.sha256(b"engine-key-%d" % i).digest() for i in range(3)]),
    ("opaque_mla", ns("team-b", DEEPSEEK, DEEPSEEK_REV, "fp8_e4m3", 64, "mla", 8, opaque=True),
     [bytes(32), bytes([0xff]) * 32]),
]


def dump(obj, indent=0) -> str:
    """JSON with one key per line, but number lists packed into lines of at most 100 columns."""
    pad = " " * indent
    if isinstance(obj, dict):
        items = [pad + " " + json.dumps(k) + ": " + dump(v, indent + 1).lstrip()
                 for k, v in obj.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and all(isinstance(x, int) for x in obj):
        lines, cur = [], ""
        for x in obj:
            piece = str(x)
            if cur and len(pad) + 1 + len(cur) + len(piece) + 2 > 100:
                lines.append(cur.rstrip())
                cur = ""
            cur += piece + ", "
        lines.append(cur.rstrip(", "))
        body = ",\n".join(pad + " " + ln.rstrip(",") for ln in lines)
        return pad + "[\n" + body + "\n" + pad + "]"
    if isinstance(obj, list) and obj:
        return pad + "[\n" + ",\n".join(dump(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return pad + json.dumps(obj, ensure_ascii=True)


def main():
    cases = []
    for name, spec, tokens in CASES:
        enc = ns_encoding(spec)
        digest = hashlib.sha256(enc).digest()
        cases.append({
            "name": name,
            "namespace": spec,
            "encoding_hex": enc.hex(),
            "ns_digest": digest.hex(),
            "tokens": tokens,
            "page_keys": [k.hex() for k in page_keys(digest, tokens, spec["page_size"])],
        })
    opaque = []
    for name, spec, engine_keys in OPAQUE_CASES:
        enc = ns_encoding(spec)
        digest = hashlib.sha256(enc).digest()
        opaque.append({
            "name": name,
            "namespace": spec,
            "encoding_hex": enc.hex(),
            "ns_digest": digest.hex(),
            "engine_keys": [k.hex() for k in engine_keys],
            "scoped_keys": [hashlib.sha256(digest + bytes(32) + k + b"\x01").digest().hex()
                            for k in engine_keys],
        })
    doc = {
        "comment": "Generated by tests/data/gen_keys_golden.py; spec in docs/keys.md. Do not edit.",
        "encoding_tag": TAG.decode(),
        "hybrid_encoding_tag": HYBRID_TAG.decode(),
        "cases": cases,
        "opaque_cases": opaque,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keys_golden.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(dump(doc) + "\n")


if __name__ == "__main__":
    main()
