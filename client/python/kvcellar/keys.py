"""Namespaces and page keys (docs/keys.md), computed by the native library.

A page key names a page of KV and every token before it: ``k_i = SHA-256(tokens of
page i as uint32 LE || k_{i-1})``, rooted at the namespace digest. Keys travel as NumPy arrays of shape
``(n, 32)`` and dtype uint8; token ids as uint32 arrays. No Python loop runs per page.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _native as N

TokensLike = Union[np.ndarray, Sequence[int]]

_U8 = np.dtype(np.uint8)
_U32 = np.dtype(np.uint32)

LAYOUTS = {"mha": N.LAYOUT_MHA, "gqa": N.LAYOUT_MHA, "mla": N.LAYOUT_MLA}
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "nvfp4", "mxfp4")


GROUP_KINDS = {"full": N.GROUP_FULL, "window": N.GROUP_WINDOW, "state": N.GROUP_STATE}


@dataclass(frozen=True)
class KvGroup:
    """One KV group of a hybrid model (docs/keys.md "Groups"): ``"full"`` attention (a hit needs
    every page before its boundary), a sliding ``"window"`` of ``window_tokens`` tokens (the pages
    of the last W - 1 tokens), or a recurrent ``"state"`` (the state saved at the boundary)."""

    kind: str
    window_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"KvGroup.kind: {self.kind!r} is not one of full, window, state")


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that decides a page's KV bytes (docs/keys.md).

    ``layout`` is ``"mha"`` (MHA and GQA: one shard per TP rank) or ``"mla"`` (one latent shard
    every rank reads). Construction validates every field and raises ``ValueError`` naming the
    first bad one: a namespace is configuration, checked before any engine step runs.
    """

    model_id: str
    model_revision: str
    kv_dtype: str
    page_size: int
    layout: str = "mha"
    tp_size: int = 1
    tenant: str = ""
    opaque_keys: bool = False
    # The KV groups of a hybrid model; () or one "full" group: a model of one group.
    groups: tuple[KvGroup, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        for i, g in enumerate(self.groups):
            if not isinstance(g, KvGroup):
                raise ValueError(f"Namespace.groups[{i}]: expected a KvGroup, got {g!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"Namespace.layout: {self.layout!r} is not one of mha, gqa, mla")
        for name in ("model_id", "model_revision", "kv_dtype", "tenant"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Namespace.{name}: must be a str")
        for name in ("page_size", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0 or v >= 2**32:
                raise ValueError(f"Namespace.{name}: {v!r} is not a u32")
        digest = (ctypes.c_uint8 * N.KEY_BYTES)()
        rc = N.lib.kvc_namespace_digest(ctypes.byref(self.to_c()), digest)
        if rc != N.OK:
            raise ValueError(f"Namespace: {N.last_error()}")
        object.__setattr__(self, "_digest", bytes(digest))
        # The C structure page_keys passes on every call, built once (it keeps its strings).
        object.__setattr__(self, "_c", self.to_c())

    @property
    def layout_code(self) -> int:
        return LAYOUTS[self.layout]

    @property
    def shards_per_page(self) -> int:
        return 1 if self.layout == "mla" else self.tp_size

    @property
    def hybrid(self) -> bool:
        """More than one full-attention group: Load and Backup name a block per (page, group)."""
        return len(self.groups) > 1 or (len(self.groups) == 1 and self.groups[0].kind != "full")

    @property
    def blocks_per_page(self) -> int:
        return len(self.groups) if self.hybrid else 1

    def digest(self) -> bytes:
        """ns_digest: SHA-256 of the canonical "kvcellar-ns-v2" encoding ("kvcellar-ns-v3" for a
        hybrid model)."""
        return self._digest  # type: ignore[attr-defined]

    def to_c(self) -> N.Namespace:
        # The encoded strings live as long as the structure (ctypes keeps c_char_p sources).
        groups = (N.KvGroup * len(self.groups))(
            *[N.KvGroup(GROUP_KINDS[g.kind], int(g.window_tokens)) for g in self.groups])
        return N.Namespace(self.tenant.encode(), self.model_id.encode(),
                           self.model_revision.encode(), self.kv_dtype.encode(),
                           int(self.page_size), self.layout_code, int(self.tp_size),
                           1 if self.opaque_keys else 0,
                           ctypes.cast(groups, ctypes.POINTER(N.KvGroup)) if self.groups else None,
                           len(self.groups))


def as_tokens(tokens: TokensLike) -> np.ndarray:
    """Token ids as a contiguous uint32 array (no copy when they already are one)."""
    if (type(tokens) is np.ndarray and tokens.dtype == _U32 and tokens.ndim == 1
            and tokens.flags.c_contiguous):
        return tokens  # what engines pass every step: nothing to check or convert
    if hasattr(tokens, "detach"):  # a torch tensor
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D array, got shape {arr.shape}")
    if arr.dtype != np.uint32:
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            raise ValueError("tokens: ids must fit in uint32")
        arr = arr.astype(np.uint32)
    return np.ascontiguousarray(arr)


def as_keys(keys: Union[np.ndarray, bytes, Sequence[bytes]]) -> np.ndarray:
    """Keys as a contiguous (n, 32) uint8 array."""
    if (type(keys) is np.ndarray and keys.dtype == _U8 and keys.ndim == 2
            and keys.shape[1] == N.KEY_BYTES and keys.flags.c_contiguous):
        return keys  # as page_keys and match return them: nothing to check or convert
    if isinstance(keys, (bytes, bytearray)):
        arr = np.frombuffer(bytes(keys), dtype=np.uint8)
    elif isinstance(keys, np.ndarray):
        arr = keys
    else:
        arr = np.frombuffer(b"".join(keys), dtype=np.uint8) if len(keys) else np.zeros(0, np.uint8)
    if arr.dtype != np.uint8:
        raise ValueError(f"keys: expected uint8, got {arr.dtype}")
    if arr.size % N.KEY_BYTES:
        raise ValueError(f"keys: {arr.size} bytes is not a multiple of {N.KEY_BYTES}")
    return np.ascontiguousarray(arr.reshape(-1, N.KEY_BYTES))


def page_keys(ns: Namespace, tokens: TokensLike, parent: Optional[bytes] = None) -> np.ndarray:
    """Keys of every full page of ``tokens``, shape (n, 32).

    ``parent`` None means the tokens start at position 0 (the chain starts at ns_digest); to
    extend a chain the engine already has, pass the key of the page before ``tokens[0]``.
    """
    # Page 0's parent is the namespace digest, computed once (the library would hash it again).
    parent_p = ns._digest  # type: ignore[attr-defined]
    if parent is not None:
        if len(parent) != N.KEY_BYTES:
            raise ValueError(f"parent: {len(parent)} bytes, expected {N.KEY_BYTES}")
        parent_p = (ctypes.c_uint8 * N.KEY_BYTES).from_buffer_copy(parent)
    return keys_of_full_pages(
        "page_keys", ns.page_size, tokens,
        lambda toks, out, n, got: N.lib.kvc_page_keys(ctypes.byref(ns._c), parent_p,  # type: ignore
                                                      N.address(toks), len(toks),
                                                      N.address(out), n, got))


def keys_of_full_pages(what: str, page_size: int, tokens: TokensLike, call: Any) -> np.ndarray:
    """Keys, shape (n, 32), of the full pages of ``tokens`` (n = len // page_size), from the
    native ``call(tokens, out, n, byref(got))``, which writes them into ``out``; ValueError
    naming ``what`` when it fails."""
    toks = as_tokens(tokens)
    n = len(toks) // page_size if page_size else 0
    out = np.empty((n, N.KEY_BYTES), dtype=np.uint8)
    got = ctypes.c_size_t(0)
    if call(toks, out, n, ctypes.byref(got)) != N.OK:
        raise ValueError(f"{what}: {N.last_error()}")
    return out if got.value == n else out[: got.value]
