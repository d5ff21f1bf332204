"""A reference engine: a transformers causal LM over a paged KV pool that kvcellar backs up.

It exists to show on a real model that pages kvcellar stores and loads reproduce the computation
without the cache (tests/test_reference_model.py), and to time the first token with the cache
against a full prefill (``python -m kvcellar.reference``). It is not a serving engine: one
request at a time, batch 1, greedy decoding, no EOS stop.

The pool is the engine's paged KV in vLLM's layouts, registered with kvcellard per TP rank:
GQA/MHA ``[2, num_blocks, page_size, kv_heads / ranks, head_dim]`` per layer (FlashAttention),
MLA ``[num_blocks, page_size, kv_lora_rank + rope_dim]`` per layer (the compressed latent that
transformers' DeepseekV3Attention caches, like vLLM's and SGLang's MLA caches). Attention itself
runs on a transformers ``DynamicCache``; the pool is where pages land from kvcellar and where new
full pages are written for backup.

Hybrid models (sliding-window layers beside full attention, e.g. Gemma 3: ``make_gemma3``) get a
hybrid namespace (docs/api.md, "Groups"): a full group and one window group per window size,
each layer in its group. A page is then one object per group, each in a pool block of its own
(Load and Backup name them page-major, NO_BLOCK where an object is not moved). A hit at boundary
h loads the full group's h pages and a window group's last ceil((W - 1) / P) only, which hold the
W - 1 tokens transformers' sliding layer keeps; a Backup stores every full page and the window
pages of the boundaries a later hit can use (``ReferenceEngine._backup``). kvcellard serves
hybrid namespaces to host-memory engines only in API revision 4: on CUDA its sessions are refused
at registration and every request is a miss.

One request (``ReferenceEngine.generate``):
  1. ``match(pin=True)`` on rank 0's session, one Match for the TP group as vLLM's scheduler
     does: h pages of the prompt are cached (h is capped so the last token is computed).
  2. ``load(keys[:h], blocks, release_pin=True)`` on every rank, layer by layer (a hybrid:
     only the objects the hit at h needs).
  3. Prefill of the suffix only (positions from h * page_size) on a DynamicCache whose first h
     pages per layer are read from the pool when that layer first runs, right after
     ``wait_layer``: layer i computes as soon as layer i has landed.
  4. ``wait()``: unless every rank reports ``leading_ok_pages == [h]`` the output is discarded and
     the whole prompt is prefilled again (a cache failure is a miss, never an error).
  5. The new full pages are written into pool blocks and backed up (``parent``: the key of page
     h - 1; a hybrid: the objects a later hit can use); greedy decoding runs while the daemon
     gathers them. Blocks are reused only once every Load and Backup on them is terminal; those
     of an op whose outcome the client lost (the daemon died during the call) are set aside
     until the client settles it.

Failure semantics: construction raises ValueError for a model, namespace or pool that do not fit
together (configuration, before any request). ``generate`` raises only ValueError for bad
arguments; a daemon that is down, killed, slow or refusing, a failed Load or Backup and a pool
too small to stage the pages all become a miss (``GenerationResult.miss_reason`` says why) and
the tokens are those of a full prefill.

Threading: one thread calls ``generate`` at a time (the engine's step). The TP ranks are sessions
of one process here: the model runs once, and rank r's pool holds KV heads
[r * kv_heads / T, (r + 1) * kv_heads / T), as each rank of a TP engine would hold its own.
"""

from __future__ import annotations

import argparse
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ._native import NO_BLOCK
from .client import Client, Op, OpStatus, Session
from .keys import KvGroup, Namespace, TokensLike, as_tokens, page_keys
from .layout import KvLayout, kv_dtype_for
from .sim import SimDevice

# The weight (and so KV pool) dtypes the reference engine runs; named by layout.kv_dtype_for.
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---- models ---------------------------------------------------------------------------------


def make_llama(seed: int = 0, *, vocab_size: int = 512, hidden_size: int = 256,
               intermediate_size: int = 512, num_layers: int = 4, num_heads: int = 8,
               num_kv_heads: int = 2, head_dim: int = 32, initializer_range: float = 0.5,
               max_positions: int = 32768, device: Union[str, torch.device] = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Llama-style GQA model with random weights from ``seed`` (nothing downloaded).

    The default ``initializer_range`` is well above Llama's 0.02: random weights that small give
    near-tied logits, so greedy tokens would flip on rounding differences."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=head_dim, initializer_range=initializer_range,
                         max_position_embeddings=max_positions)
    return _build(AutoModelForCausalLM, config, seed, device, dtype)


def make_deepseek_mla(seed: int = 0, *, vocab_size: int = 512, hidden_size: int = 256,
                      intermediate_size: int = 512, num_layers: int = 4, num_heads: int = 8,
                      kv_lora_rank: int = 64, qk_rope_head_dim: int = 16,
                      qk_nope_head_dim: int = 32, v_head_dim: int = 32,
                      initializer_range: float = 0.5, max_positions: int = 32768,
                      device: Union[str, torch.device] = "cpu",
                      dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A DeepSeek-V3-style MLA model, every layer dense (no MoE), q_lora_rank None, random
    weights from ``seed``. Its attention caches the latent (kv_nope, k_rot)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(vocab_size=vocab_size, hidden_size=hidden_size,
                              intermediate_size=intermediate_size,
                              moe_intermediate_size=intermediate_size // 4,
                              num_hidden_layers=num_layers, num_attention_heads=num_heads,
                              num_key_value_heads=num_heads, n_routed_experts=4,
                              n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=num_layers, q_lora_rank=None,
                              kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                              qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                              initializer_range=initializer_range,
                              max_position_embeddings=max_positions, num_mtp_layers=0)
    return _build(AutoModelForCausalLM, config, seed, device, dtype)


def make_gemma3(seed: int = 0, *, vocab_size: int = 512, hidden_size: int = 256,
                intermediate_size: int = 512, num_layers: int = 4, num_heads: int = 8,
                num_kv_heads: int = 2, head_dim: int = 32, sliding_window: int = 64,
                full_every: int = 2, initializer_range: float = 0.5, max_positions: int = 32768,
                device: Union[str, torch.device] = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Gemma 3 text model with random weights from ``seed``: a hybrid whose every
    ``full_every``-th layer is full attention and the others attend to a sliding window of
    ``sliding_window`` tokens (the token and the W - 1 before it; Gemma 3 itself: 1024 tokens, 5
    of every 6 layers). Its namespace has a full and a window KV group (namespace_for).

    The output embedding is not tied to the input one (Gemma 3's is): with random weights, tied
    ones make every prompt decode the same token over and over."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    layer_types = ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
                   for i in range(num_layers)]
    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                              intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                              num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                              head_dim=head_dim, query_pre_attn_scalar=head_dim,
                              sliding_window=sliding_window, layer_types=layer_types,
                              initializer_range=initializer_range,
                              max_position_embeddings=max_positions, tie_word_embeddings=False)
    return _build(AutoModelForCausalLM, config, seed, device, dtype)


def _build(auto: Any, config: Any, seed: int, device: Union[str, torch.device],
           dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):  # weights are created where they run (a 32-layer model on GPU)
        model = auto.from_config(config, dtype=dtype)
    return model.eval()


def namespace_for(model: torch.nn.Module, *, page_size: int = 16, tp_size: int = 1,
                  model_id: str = "", revision: str = "") -> Namespace:
    """The namespace of ``model``'s KV: kv_dtype from its weights, layout from its attention,
    KV groups from its cache layers (KvGeometry.groups), and by default a revision that
    fingerprints its config and weights, so that two random models (another seed, another
    device's initialization) never share pages."""
    geo = KvGeometry.of(model)
    return Namespace(model_id or type(model).__name__, revision or weights_fingerprint(model),
                     kv_dtype_for(geo.dtype), page_size, layout="mla" if geo.mla else "gqa",
                     tp_size=tp_size, groups=geo.groups)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits of SHA-256 over the config and the first values of every parameter."""
    import hashlib

    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().flatten()[:16].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class KvGeometry:
    """What a model's cache layer holds per token, in transformers' [batch, heads, seq, dim]
    form: K/V heads of head_dim, or for MLA one "head" of kv_nope (as K) and one of k_rot
    (as V). ``windows``: per layer, the sliding window in tokens of a window layer, 0 for full
    attention (cache_windows)."""

    num_layers: int
    mla: bool
    heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    windows: tuple[int, ...]

    @property
    def groups(self) -> tuple[KvGroup, ...]:
        """The namespace's KV groups: none for a model of full attention only, else the full
        group first, then a window group per distinct window, smallest first."""
        return (KvGroup("full"), *(KvGroup("window", w) for w in self._distinct_windows)
                ) if self._distinct_windows else ()

    @property
    def layer_groups(self) -> list[int]:
        """Each layer's index in ``groups`` (all 0 for a model of one group)."""
        ws = self._distinct_windows
        return [ws.index(w) + 1 if w else 0 for w in self.windows]

    @property
    def _distinct_windows(self) -> list[int]:
        return sorted(set(self.windows) - {0})

    @classmethod
    def of(cls, model: torch.nn.Module) -> "KvGeometry":
        c = model.config
        dtype = next(model.parameters()).dtype
        if dtype not in POOL_DTYPES:
            raise ValueError(f"model: weights of {dtype}; the pool supports {list(POOL_DTYPES)}")
        windows = cache_windows(model)
        if getattr(c, "kv_lora_rank", None):
            return cls(c.num_hidden_layers, True, 1, c.kv_lora_rank, c.qk_rope_head_dim, dtype,
                       windows)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return cls(c.num_hidden_layers, False, kv_heads, head_dim, head_dim, dtype, windows)


def cache_windows(model: torch.nn.Module) -> tuple[int, ...]:
    """Per layer of the model's DynamicCache, 0 for full attention (a DynamicLayer) or the
    window W of a sliding-window layer (a DynamicSlidingWindowLayer, which transformers gives
    the token and the W - 1 before it, as kvcellar's window groups count). ValueError for any
    other layer (chunked, linear-attention, shared-KV layers are not paged here) and for a model
    without a full-attention layer (a hybrid namespace needs one: it keeps the index
    prefix-closed)."""
    layers = DynamicCache(config=model.config).layers
    n = model.config.num_hidden_layers
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * n
    windows: list[int] = []
    for layer, kind in zip(layers, kinds):
        if type(layer) is DynamicLayer and kind == "full_attention":
            windows.append(0)
        elif type(layer) is DynamicSlidingWindowLayer and kind == "sliding_attention":
            windows.append(int(layer.sliding_window))
    if len(layers) != n or len(windows) != n:
        raise ValueError(f"model: cache layers {[type(x).__name__ for x in layers]} of "
                         f"{list(kinds)}; only full attention (DynamicLayer) and sliding windows "
                         "(DynamicSlidingWindowLayer) are supported")
    if 0 not in windows:
        raise ValueError("model: every layer has a sliding window; kvcellar's hybrid namespaces "
                         "need a full-attention layer")
    return tuple(windows)


# ---- the paged pool -------------------------------------------------------------------------


class PagedKvPool:
    """Per TP rank, per layer, the engine's paged KV in vLLM's layout (module docstring). On CPU
    every rank's tensors live in one shared-memory object of its own SimDevice (the daemon maps
    it); on CUDA in one torch allocation (the daemon opens it through CUDA IPC).

    ``write`` and ``read`` take K/V in transformers' form ([heads, tokens, dim], tokens a whole
    number of pages) and block ids as a device tensor: rank r holds heads
    [r * heads / T, (r + 1) * heads / T); for MLA every rank holds the whole latent."""

    def __init__(self, geo: KvGeometry, ranks: int, num_blocks: int, page_size: int,
                 device: torch.device) -> None:
        if not geo.mla and geo.heads % ranks:
            raise ValueError(f"rank_count: {ranks} does not divide the {geo.heads} KV heads")
        self.geo, self.ranks, self.page_size, self.device = geo, ranks, page_size, device
        self.num_blocks = num_blocks
        self.heads_per_rank = 1 if geo.mla else geo.heads // ranks
        if geo.mla:
            shape: tuple[int, ...] = (geo.num_layers, num_blocks, page_size, geo.k_dim + geo.v_dim)
        else:
            shape = (geo.num_layers, 2, num_blocks, page_size, self.heads_per_rank, geo.k_dim)
        self.sims: list[Optional[SimDevice]] = []
        self.tensors: list[list[torch.Tensor]] = []  # [rank][layer]
        for _ in range(ranks):
            sim = SimDevice("ref") if device.type == "cpu" else None
            raw = (sim.empty(shape, geo.dtype) if sim is not None
                   else torch.empty(shape, dtype=geo.dtype, device=device))
            self.sims.append(sim)
            self.tensors.append([raw[i] for i in range(geo.num_layers)])

    def layout(self, rank: int) -> KvLayout:
        groups = self.geo.layer_groups if self.geo.groups else None
        return KvLayout.from_vllm(self.tensors[rank], mla=self.geo.mla, device=self.sims[rank],
                                  groups=groups)

    def write(self, layer: int, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n, p = len(blocks), self.page_size
        if self.geo.mla:
            latent = torch.cat([k[0], v[0]], dim=-1).view(n, p, -1)
            for per_layer in self.tensors:
                per_layer[layer].index_copy_(0, blocks, latent)
            return
        hr = self.heads_per_rank
        for r, per_layer in enumerate(self.tensors):
            t = per_layer[layer]
            for kv, src in ((0, k), (1, v)):
                pages = src[r * hr:(r + 1) * hr].reshape(hr, n, p, -1).permute(1, 2, 0, 3)
                t[kv].index_copy_(0, blocks, pages)

    def read(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, heads, pages * page_size, dim] K and V, copies (the blocks may be reused)."""
        tokens = len(blocks) * self.page_size
        if self.geo.mla:  # each rank loaded the same latent into its own blocks; rank 0's is used
            lat = self.tensors[0][layer].index_select(0, blocks).view(1, 1, tokens, -1)
            return lat[..., :self.geo.k_dim], lat[..., self.geo.k_dim:]
        k = torch.cat([t[layer][0].index_select(0, blocks).view(tokens, self.heads_per_rank, -1)
                       for t in self.tensors], dim=1)
        v = torch.cat([t[layer][1].index_select(0, blocks).view(tokens, self.heads_per_rank, -1)
                       for t in self.tensors], dim=1)
        return k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)

    def close(self) -> None:
        self.tensors = []
        for sim in self.sims:
            if sim is not None:
                sim.close()
        self.sims = []


class _BlockAllocator:
    """Free block ids of the pool. Blocks a Load or Backup used come back only once every op on
    them is terminal: a submission whose outcome was lost (the daemon died during the call) may
    still write or read them until the client settles its session generation. Until then they
    wait in ``deferred``, reaped without blocking when ``take`` runs short."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.deferred: list[tuple[np.ndarray, list[Op]]] = []

    @property
    def num_deferred(self) -> int:
        return sum(len(blocks) for blocks, _ in self.deferred)

    def take(self, n: int) -> Optional[np.ndarray]:
        if n > len(self.free) and self.deferred:
            self.reap()
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return np.asarray(out, dtype=np.int64)

    def give(self, blocks: Optional[np.ndarray], ops: Sequence[Op],
             statuses: Sequence[OpStatus]) -> None:
        """Gives ``blocks`` back now if every op's status is terminal, else defers them."""
        if blocks is None:
            return
        if all(st.terminal for st in statuses):
            self.free.extend(int(b) for b in blocks)
        else:
            self.deferred.append((blocks, list(ops)))

    def reap(self) -> None:
        still = []
        for blocks, ops in self.deferred:
            if all(op.wait(0).terminal for op in ops):
                self.free.extend(int(b) for b in blocks)
            else:
                still.append((blocks, ops))
        self.deferred = still


def _settle(ops: Sequence[Op], timeout_ms: int) -> list[OpStatus]:
    """Each op's status, waiting up to ``timeout_ms`` only while its session is active: an op of
    a session that lost the daemon stays pending until the client settles it, and the engine's
    step does not wait for that (its blocks are deferred instead)."""
    out = []
    for op in ops:
        st = op.wait(0)
        if not st.terminal and op.session.state == "active":
            st = op.wait(timeout_ms)
        out.append(st)
    return out


# ---- a DynamicCache filled from the pool, layer by layer ------------------------------------


class _LoadFailed(Exception):
    """Raised inside the forward when a layer will never land; caught by the engine (a miss)."""


class LayerwisePrefixCache(DynamicCache):
    """The DynamicCache of a prefill whose first ``prefix_len`` positions come from
    ``fill(layer)``, called once per layer on that layer's first ``update``: the layer computes
    as soon as its pages have landed, not after the whole Load. Until then each layer holds a
    placeholder of what a prefill of the prefix would have left in it (a zero-stride view,
    nothing allocated) so that transformers derives positions and masks from it as for a cache
    already filled: a full layer all ``prefix_len`` positions, a window layer of W tokens the
    last min(prefix_len, W - 1) (and ``cumulative_length`` the prefix's). ``fill`` returns whole
    pages ending at the prefix's end; a window layer keeps their last tokens only.

    Window layers record every token they see until ``end_prefill`` (transformers' past
    recording: what attention sees is unchanged), so that the Backup can store window pages
    further back than the W - 1 tokens such a layer keeps. ``end_prefill`` cuts them back to
    what a prefill leaves, before decoding."""

    def __init__(self, config: Any, geo: KvGeometry, prefix_len: int, device: torch.device,
                 fill: Optional[Callable[[int], tuple[torch.Tensor, torch.Tensor]]]) -> None:
        super().__init__(config=config)  # a layer per KvGeometry.windows entry (cache_windows)
        self._fill = fill
        self._pending = set(range(geo.num_layers)) if prefix_len else set()
        zero = torch.zeros((), dtype=geo.dtype, device=device)
        for layer, window in zip(self.layers, geo.windows):
            if window:
                layer.activate_past_recording()
            if not prefix_len:
                continue
            held = min(prefix_len, window - 1) if window else prefix_len
            layer.lazy_initialization(zero, zero)
            layer.keys = zero.expand(1, geo.heads, held, geo.k_dim)
            layer.values = zero.expand(1, geo.heads, held, geo.v_dim)
            if window:
                layer.cumulative_length = prefix_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self._pending:
            self._pending.discard(layer_idx)
            layer = self.layers[layer_idx]
            k, v = self._fill(layer_idx)
            held = layer.keys.shape[-2]  # the placeholder's: what a prefill would have left
            layer.keys, layer.values = k[..., -held:, :], v[..., -held:, :]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def end_prefill(self) -> None:
        """Window layers back to what a prefill leaves them: the last W - 1 tokens, no longer
        recording (decoding then runs as without kvcellar)."""
        for layer in self.layers:
            if isinstance(layer, DynamicSlidingWindowLayer) and layer.record_past:
                layer.crop(0)
                layer.record_past = False

    def first_position(self, layer_idx: int) -> int:
        """The prompt position of ``layers[layer_idx].keys[..., 0, :]`` (0 but for a window
        layer that has dropped tokens)."""
        layer = self.layers[layer_idx]
        return layer.get_seq_length() - layer.keys.shape[-2]


# ---- the engine -----------------------------------------------------------------------------


@dataclass
class GenerationResult:
    """One request's outcome. ``logits[i]`` are the float32 logits that chose ``tokens[i]``.

    ``matched_pages``: the prompt's pages kvcellar had; ``hit_pages``: those loaded and used (0
    on a miss or a failed Load); ``prefill_tokens``: tokens the prefill computed;
    ``backed_up_pages``: new full pages stored on every rank; ``miss_reason``: why the cache
    could not serve or store this request ("" when it did); ``ttft_s``: seconds from the call
    to the first token. With ``keep_kv``: ``loaded_kv`` per layer the (K, V) read from
    the pool for the hit pages, and ``prefill_kv`` per layer the (K, V) of the whole prompt after
    prefill, both [heads, tokens, dim] (MLA: K is kv_nope, V is k_rot, one head). A window
    layer's ``loaded_kv`` holds only the window pages loaded (the last ones before the hit's
    boundary), its ``prefill_kv`` the positions it held at the end of the prefill: every one
    without a hit, else from W - 1 before the boundary on."""

    tokens: list[int]
    logits: torch.Tensor
    hit_pages: int = 0
    prefill_tokens: int = 0
    matched_pages: int = 0
    backed_up_pages: int = 0
    miss_reason: str = ""
    ttft_s: float = 0.0
    loaded_kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
    prefill_kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None


@dataclass
class _Prefill:
    cache: LayerwisePrefixCache
    logits: torch.Tensor  # [vocab], the last prompt position
    hit_pages: int = 0
    loaded_kv: Optional[list] = None


@dataclass
class _Backup:
    ops: list[Op] = field(default_factory=list)
    blocks: Optional[np.ndarray] = None
    reason: str = ""


class ReferenceEngine:
    """A transformers causal LM with a paged KV pool of ``num_blocks`` pages per rank, backed by
    kvcellar through one session per TP rank (``rank_count`` ranks of ``instance_id``).

    ``client`` None: no cache at all. Raises ValueError at construction for a namespace that does
    not fit the model (layout, tp_size, kv_dtype) or a registration the daemon would refuse; a
    daemon that is down is not an error (the sessions register in the background)."""

    def __init__(self, model: torch.nn.Module, client: Optional[Client], ns: Namespace,
                 instance_id: str = "reference-engine", *, rank_count: int = 1,
                 device: Union[str, torch.device, None] = None, num_blocks: int = 256,
                 timeout_ms: int = 2000) -> None:
        self.model = model
        self.geo = KvGeometry.of(model)
        self.device = torch.device(device) if device is not None else next(
            model.parameters()).device
        self.ns = ns
        self.page_size = ns.page_size
        self.timeout_ms = timeout_ms
        if ns.tp_size != rank_count:
            raise ValueError(f"ns.tp_size: {ns.tp_size}, but rank_count is {rank_count}")
        if (ns.layout == "mla") != self.geo.mla:
            raise ValueError(f"ns.layout: {ns.layout!r} for a {'MLA' if self.geo.mla else 'GQA'} "
                             "model")
        if ns.kv_dtype != kv_dtype_for(self.geo.dtype):
            raise ValueError(f"ns.kv_dtype: {ns.kv_dtype!r}, the model computes "
                             f"{kv_dtype_for(self.geo.dtype)!r}")
        if (ns.groups if ns.hybrid else ()) != self.geo.groups:
            raise ValueError(f"ns.groups: {ns.groups}, the model's cache layers make "
                             f"{self.geo.groups}")
        # Per group, the pages before a boundary a hit needs: None for every page (full
        # attention), else a window's ceil((W - 1) / P) (docs/api.md, "Groups").
        self._group_pages = [None if g.kind == "full" else
                             -(-(g.window_tokens - 1) // self.page_size)
                             for g in self.geo.groups] or [None]
        self._layer_groups = self.geo.layer_groups
        self.pool = PagedKvPool(self.geo, rank_count, num_blocks, ns.page_size, self.device)
        self.blocks = _BlockAllocator(num_blocks)
        self.sessions: list[Session] = []
        if client is not None:
            try:
                self.sessions = [client.register(instance_id, ns, layout=self.pool.layout(r),
                                                 rank=r) for r in range(rank_count)]
            except ValueError:
                self.close()
                raise
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    # ---- lifecycle ---------------------------------------------------------------------------

    def wait_active(self, timeout_ms: int = 5000) -> bool:
        """True once every rank is registered with the daemon."""
        return all(s.wait_active(timeout_ms) for s in self.sessions)

    def close(self) -> None:
        """Closes the sessions (not the client) and unmaps the pool: its tensors must not be
        used after this. Idempotent."""
        for s in self.sessions:
            s.close()
        self.sessions = []
        self.pool.close()

    def __enter__(self) -> "ReferenceEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- a request ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, tokens: TokensLike, max_new_tokens: int, *, use_cache: bool = True,
                 keep_kv: bool = False) -> GenerationResult:
        """Prefills ``tokens`` (from kvcellar's pages where cached, when ``use_cache``) and
        decodes ``max_new_tokens`` tokens greedily. Raises ValueError only for bad arguments;
        every cache failure is a miss and the result is that of a full prefill."""
        toks = as_tokens(tokens)
        if len(toks) == 0 or max_new_tokens < 1:
            raise ValueError(f"tokens: {len(toks)}, max_new_tokens: {max_new_tokens}; need >= 1")
        use_cache = use_cache and bool(self.sessions)
        t0 = time.perf_counter()
        pre, matched, reason, keys = None, 0, "", None
        if use_cache:
            keys = page_keys(self.ns, toks)
            pre, matched, reason = self._prefill_from_cache(toks, keys, keep_kv)
        if pre is None:
            pre = self._forward_prompt(toks, self._prefix_cache(0, None), 0)
        first = int(pre.logits.argmax())  # synchronizes: the first token exists now
        ttft = time.perf_counter() - t0
        backup = _Backup()
        if keys is not None:
            backup = self._backup(pre.cache, keys, pre.hit_pages, len(toks))
        prefill_kv = None
        if keep_kv:
            prefill_kv = [(x.keys[0].clone(), x.values[0].clone()) for x in pre.cache.layers]
        pre.cache.end_prefill()
        out, logits = self._decode(pre.cache, first, pre.logits, len(toks), max_new_tokens)
        backed_up = self._settle_backup(backup)
        return GenerationResult(out, logits, pre.hit_pages,
                                len(toks) - pre.hit_pages * self.page_size, matched, backed_up,
                                reason or backup.reason, ttft,
                                pre.loaded_kv, prefill_kv)

    def _forward_prompt(self, toks: np.ndarray, cache: LayerwisePrefixCache,
                        start: int) -> _Prefill:
        """Prefill of toks[start:] at positions from ``start`` over ``cache`` (holding start)."""
        ids = torch.as_tensor(toks[start:].astype(np.int64), device=self.device).unsqueeze(0)
        pos = torch.arange(start, len(toks), device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kwarg: cache})
        return _Prefill(cache, out.logits[0, -1].float())

    def _prefill_from_cache(self, toks: np.ndarray, keys: np.ndarray,
                            keep_kv: bool) -> tuple[Optional[_Prefill], int, str]:
        """Match, Load and the suffix's prefill: (the prefill or None, pages matched, why
        matched pages were not used). None: recompute the whole prompt."""
        # At least the last prompt token is computed: its logits give the first token.
        cap = (len(toks) - 1) // self.page_size
        # A hybrid's hits are not prefix-closed (a shorter boundary needs window pages further
        # back than a longer one), so the daemon is asked for the longest boundary within the
        # cap instead of one cut down to it.
        m = self.sessions[0].match([keys[:cap] if self.ns.hybrid else keys], by_keys=True,
                                   pin=True)
        r = m.results[0]
        h = min(r.l2_hit_pages, cap)
        if not m.ok or h == 0:
            self._release_pin(r.pin_id)
            return None, 0, "" if m.ok else f"match: {m.reason}"
        placed = self._place(self._objects((h,), 0, h))
        if placed is None:
            self._release_pin(r.pin_id)
            return None, r.l2_hit_pages, "pool: no free blocks to load into"
        blocks, grid = placed
        ops = [s.load(keys[:h], grid.ravel(), pin_id=r.pin_id, release_pin=True)
               for s in self.sessions]
        for s, op in zip(self.sessions, ops):
            if not op.op_id:
                s.release([r.pin_id])  # never accepted: drop this rank's hold now
        pre, reason = self._prefill_suffix(toks, h, blocks, self._group_blocks(grid), ops,
                                           keep_kv)
        return pre, r.l2_hit_pages, reason

    def _objects(self, boundaries: Sequence[int], lo: int, hi: int) -> np.ndarray:
        """[hi - lo, groups] bools: the objects of pages [lo, hi) that a hit at any of
        ``boundaries`` needs: a full group's every page before the boundary, a window group's
        last ceil((W - 1) / P) of them (docs/api.md, "Groups"). A model of one group: one
        column, every page."""
        pages = np.arange(lo, hi)
        need = np.zeros((hi - lo, len(self._group_pages)), dtype=bool)
        for b in boundaries:
            for g, window_pages in enumerate(self._group_pages):
                first = 0 if window_pages is None else b - window_pages
                need[:, g] |= (pages >= first) & (pages < b)
        return need

    def _place(self, need: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """A free block for every needed object: (the blocks taken, the [pages, groups] grid of
        block ids in Load and Backup's page-major order, NO_BLOCK where an object is not
        moved), or None when the pool has too few free blocks."""
        blocks = self.blocks.take(int(need.sum()))
        if blocks is None:
            return None
        grid = np.full(need.shape, NO_BLOCK, dtype=np.uint32)
        grid[need] = blocks  # row-major: page by page, each page's groups in order
        return blocks, grid

    def _group_blocks(self, grid: np.ndarray) -> list[torch.Tensor]:
        """Per group, the blocks of its moved objects in page order, as a device tensor."""
        return [torch.as_tensor(col[col != NO_BLOCK].astype(np.int64), device=self.device)
                for col in grid.T]

    def _release_pin(self, pin_id: int) -> None:
        """Drops every rank's hold of a pin no Load will release (else its lease lapses)."""
        if pin_id:
            for s in self.sessions:
                s.release([pin_id])

    def _prefill_suffix(self, toks: np.ndarray, h: int, blocks: np.ndarray,
                        group_blocks: list[torch.Tensor], ops: list[Op],
                        keep_kv: bool) -> tuple[Optional[_Prefill], str]:
        """The suffix's prefill over the loading prefix. Its output counts only when every
        rank's Load delivered all h pages; the blocks are reused only once every Load is
        terminal."""
        loaded: list[tuple[torch.Tensor, torch.Tensor]] = []

        def fill(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            for op in ops:
                if not op.wait_layer(layer, self.timeout_ms):
                    raise _LoadFailed(f"load: layer {layer} never landed")
            k, v = self.pool.read(layer, group_blocks[self._layer_groups[layer]])
            if keep_kv:
                loaded.append((k[0], v[0]))
            return k, v

        pre, reason = None, ""
        failed = [op.reason for op in ops if not op.ok]
        if failed:
            reason = f"load: {failed[0]}"
        else:
            try:
                start = h * self.page_size
                pre = self._forward_prompt(toks, self._prefix_cache(start, fill), start)
            except _LoadFailed as e:
                reason = str(e)
        statuses = _settle(ops, self.timeout_ms)
        for st in statuses:
            if not reason and not (st.done and st.leading_ok_pages == [h]):
                reason = f"load: {st.state}, {st.leading_ok_pages} of {h} pages {st.reason}"
        self.blocks.give(blocks, ops, statuses)
        if pre is None or reason:
            return None, reason.strip()
        pre.hit_pages, pre.loaded_kv = h, loaded if keep_kv else None
        return pre, ""

    def _prefix_cache(self, prefix_len: int,
                      fill: Optional[Callable[[int], tuple[torch.Tensor, torch.Tensor]]]
                      ) -> LayerwisePrefixCache:
        return LayerwisePrefixCache(self.model.config, self.geo, prefix_len, self.device, fill)

    def _backup(self, cache: LayerwisePrefixCache, keys: np.ndarray, h: int,
                length: int) -> _Backup:
        """Writes the objects of the prompt's full pages past the hit that a later hit can use
        into pool blocks and backs them up (MLA: rank 0, the shard writer, only). Returns at
        once; ``_settle_backup`` waits."""
        if len(keys) <= h:
            return _Backup()
        # Every full-attention object is stored. A window object serves only the boundaries
        # whose window holds it, and a later request hits this prompt's pages at one of two:
        # after all of them (len(keys): a prompt that goes on from this one) or at this
        # prompt's own cap ((length - 1) // P: the same prompt again, one page less when it
        # ends on a page boundary). The window pages of those two are stored, at most
        # ceil((W - 1) / P) + 1 whatever the prompt's length. Serving every boundary (a prompt
        # that leaves this one part way) would take every window page, as many objects as a
        # full group; such a prompt misses instead and stores the window of its own boundary.
        # The window pages of these boundaries before h lie in the window of the hit at h:
        # stored already.
        need = self._objects((len(keys), (length - 1) // self.page_size), h, len(keys))
        placed = self._place(need)
        if placed is None:
            return _Backup(reason="pool: no free blocks to back up")
        blocks, grid = placed
        group_blocks = self._group_blocks(grid)
        p, offsets = self.page_size, torch.arange(self.page_size)
        for i, layer in enumerate(cache.layers):
            g = self._layer_groups[i]
            pages = torch.as_tensor(h + np.flatnonzero(need[:, g]))
            if not len(pages):
                continue  # a window of one token: no page before a boundary is ever needed
            # The pages' tokens, counted from the first position the layer still holds.
            tokens = ((pages[:, None] * p + offsets).flatten() -
                      cache.first_position(i)).to(self.device)
            self.pool.write(i, group_blocks[g], layer.keys[0].index_select(1, tokens),
                            layer.values[0].index_select(1, tokens))
        parent = bytes(keys[h - 1]) if h else None
        writers = self.sessions[:1] if self.geo.mla else self.sessions
        ops = [s.backup(keys[h:], grid.ravel(), parent=parent, ready=True) for s in writers]
        failed = [op.reason for op in ops if not op.ok]
        return _Backup(ops, blocks, f"backup: {failed[0]}" if failed else "")

    def _settle_backup(self, b: _Backup) -> int:
        """Waits for the Backup (``_settle``); its blocks come back once it is terminal. Returns
        the pages stored on every rank (0 on any failure: the pages are simply not cached)."""
        if b.blocks is None:
            return 0
        statuses = _settle(b.ops, self.timeout_ms)
        self.blocks.give(b.blocks, b.ops, statuses)
        return min((st.leading_ok_pages[0] if st.done else 0 for st in statuses), default=0)

    def _decode(self, cache: DynamicCache, first: int, first_logits: torch.Tensor,
                length: int, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        tokens, logits = [first], [first_logits.cpu()]
        for step in range(1, max_new_tokens):
            ids = torch.tensor([[tokens[-1]]], device=self.device)
            pos = torch.tensor([[length + step - 1]], device=self.device)
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True,
                             **{self._cache_kwarg: cache})
            lg = out.logits[0, -1].float()
            tokens.append(int(lg.argmax()))
            logits.append(lg.cpu())
        return tokens, torch.stack(logits)


# ---- timing: first token with the cache vs a full prefill ------------------------------------


def time_first_token(engine: ReferenceEngine, prefix_tokens: int, suffix_tokens: int, *,
                     repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """Times the first token of requests sharing a ``prefix_tokens`` prefix (whole pages) with
    their own ``suffix_tokens`` suffixes, with the cache (the prefix loaded) and with a full
    prefill, alternating in one run. A first request backs the prefix up; a short request warms
    the model up. Returns medians in seconds, hit pages and whether the tokens agreed."""
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, prefix_tokens - prefix_tokens % engine.page_size)
    engine.generate(rng.integers(0, vocab, 2 * engine.page_size + 1), 2, use_cache=False)
    first = engine.generate(np.concatenate([prefix, rng.integers(0, vocab, suffix_tokens)]), 1)
    cached, full, hits, agree, reasons = [], [], [], True, set()
    for _ in range(repeats):
        prompt = np.concatenate([prefix, rng.integers(0, vocab, suffix_tokens)])
        a = engine.generate(prompt, 1, use_cache=True)
        b = engine.generate(prompt, 1, use_cache=False)
        cached.append(a.ttft_s)
        full.append(b.ttft_s)
        hits.append(a.hit_pages)
        agree = agree and a.tokens == b.tokens
        reasons |= {a.miss_reason} - {""}
    return {"prefix_tokens": len(prefix), "suffix_tokens": suffix_tokens,
            "first_request_backed_up_pages": first.backed_up_pages,
            "hit_pages": hits, "ttft_cached_s": float(np.median(cached)),
            "ttft_full_prefill_s": float(np.median(full)),
            "speedup": float(np.median(full) / max(np.median(cached), 1e-9)),
            "tokens_agree": agree, "miss_reasons": sorted(reasons)}


def _start_daemon(binary: str, directory: str, capacity: str) -> tuple[Any, str]:
    """A kvcellard child on a socket in ``directory`` (its log beside it)."""
    import subprocess

    sock = f"{directory}/kvcellard.sock"
    with open(f"{directory}/kvcellard.log", "w") as log:
        proc = subprocess.Popen([binary, "--set", f"listen.unix_socket={sock}",
                                 "--set", f"listen.admin_socket={directory}/admin.sock",
                                 "--set", "http.address=127.0.0.1:0",
                                 "--set", f"pool.capacity={capacity}"],
                                stdout=log, stderr=subprocess.STDOUT)
    return proc, sock


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m kvcellar.reference``: time to first token with the cache vs a full prefill.
    Defaults: a Llama-8B-shaped random model (32 layers, 8 KV heads x 128) in bf16 on cuda and a
    16K-token prefix; ``--kvcellard build/bin/kvcellard`` starts a daemon on a temp socket."""
    import json
    import tempfile

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--socket", help="a running kvcellard's socket")
    ap.add_argument("--kvcellard", help="start this kvcellard binary instead")
    ap.add_argument("--pool-capacity", default="8GiB", help="its pool.capacity")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--mla", action="store_true", help="a DeepSeek-V3-style MLA model")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--init-range", type=float, default=0.5,
                    help="initializer_range of the random weights (larger: clearer greedy tokens)")
    ap.add_argument("--kv-lora-rank", type=int, default=512, help="MLA: the latent's width")
    ap.add_argument("--rope-dim", type=int, default=64, help="MLA: qk_rope_head_dim")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=16384)
    ap.add_argument("--suffix-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                  intermediate_size=args.intermediate, num_layers=args.layers,
                  num_heads=args.heads, max_positions=args.prefix_tokens + 2 * args.suffix_tokens,
                  initializer_range=args.init_range, device=args.device, dtype=dtype)
    if args.mla:
        model = make_deepseek_mla(kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim,
                                  qk_nope_head_dim=args.head_dim, v_head_dim=args.head_dim,
                                  **common)
    else:
        model = make_llama(num_kv_heads=args.kv_heads, head_dim=args.head_dim, **common)
    ns = namespace_for(model, page_size=args.page_size, tp_size=args.tp)
    pages = (args.prefix_tokens + args.suffix_tokens) // args.page_size + 2
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = None, args.socket
        if args.kvcellard:
            proc, sock = _start_daemon(args.kvcellard, tmp, args.pool_capacity)
        try:
            with Client(sock) as client, ReferenceEngine(model, client, ns, "ttft",
                                                         rank_count=args.tp,
                                                         num_blocks=2 * pages) as engine:
                if not engine.wait_active(30000):
                    raise SystemExit("kvcellard: not reachable")
                out = time_first_token(engine, args.prefix_tokens, args.suffix_tokens,
                                       repeats=args.repeats)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait()
    out.update(device=str(engine.device), dtype=args.dtype, layers=args.layers,
               kv_layout=ns.layout, tp=args.tp)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
