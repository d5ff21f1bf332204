"""KV layouts derived from an engine's KV-cache tensors.

The daemon sees an engine's KV cache as bytes (core/kv_layout.h): memory regions, and per layer a
K and a V buffer (MLA: one latent buffer) where block ``b`` is ``bytes_per_block`` bytes at
``offset + b * block_stride`` inside a region. This module derives that description from PyTorch
tensors, whatever their arrangement, as long as each block's bytes are contiguous:

- vLLM: a per-layer tensor ``[2, num_blocks, block_size, heads, head_size]`` (FlashAttention;
  any stride order within a block), ``[num_blocks, 2, ...]`` (FlashInfer), or MLA's
  ``[num_blocks, block_size, latent]``; views into one shared allocation are fine.
- SGLang: per-layer token-major ``k_buffer``/``v_buffer`` ``[tokens, heads, head_dim]`` (a page is
  ``page_size`` consecutive token slots) and MLA's ``kv_buffer`` ``[tokens, 1, latent]``.

Regions come from the tensors' storage: on CUDA the IPC handle of the allocation holding the
storage and the storage's offset in it (a tensor need not start at its allocation base); on the
sim device the shared-memory object holding the tensor (``SimDevice``). Every check raises
``ValueError`` naming the argument, before anything reaches the daemon.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from . import _native as N

# torch dtype name -> namespace kv_dtypes that may store it (fp8 caches are often held as uint8).
_DTYPE_KV = {
    "float32": ("fp32",),
    "float16": ("fp16",),
    "bfloat16": ("bf16",),
    "float8_e4m3fn": ("fp8_e4m3",),
    "float8_e5m2": ("fp8_e5m2",),
    "int8": ("int8",),
    "uint8": ("fp8_e4m3", "fp8_e5m2", "int8", "nvfp4", "mxfp4"),
}


def kv_dtype_for(dtype: Any) -> Optional[str]:
    """The Namespace.kv_dtype that names KV tensors of torch ``dtype``; None when the dtype
    alone does not say which format it holds (uint8 carries several 8-bit formats)."""
    names = _DTYPE_KV.get(str(dtype).replace("torch.", ""), ())
    return names[0] if len(names) == 1 else None


@dataclass
class Region:
    # sim: shm object name, or "/proc/<pid>/mem" (offset: an address of this process); CUDA: the
    # 64-byte cudaIpcMemHandle_t
    handle: Union[str, bytes]
    offset: int
    size: int


@dataclass
class Buffer:
    region: int
    offset: int
    block_stride: int
    bytes_per_block: int

    def span(self, num_blocks: int) -> tuple[int, int]:
        return self.offset, self.offset + (num_blocks - 1) * self.block_stride + self.bytes_per_block


@dataclass
class KvLayout:
    """The bytes-only layout RegisterEngine takes, plus what was learnt from the tensors."""

    regions: list[Region]
    layers: list[tuple[Buffer, Optional[Buffer]]]
    num_blocks: int
    device_kind: int  # N.DEVICE_SIM or N.DEVICE_CUDA
    device_uuid: bytes = b"\0" * 16
    device_name: str = ""
    dtype: str = ""  # torch dtype name, e.g. "bfloat16"
    tokens_per_block: int = 0  # 0: unknown
    cuda_device: Optional[int] = None
    # Per layer, its KV group (Namespace.groups index) for a hybrid model; empty: all group 0.
    groups: list[int] = field(default_factory=list)
    # Per group, its own pool's block count when the groups do not share one pool of num_blocks
    # (SGLang's host pools per KV kind; num_blocks is then the largest); empty: one shared pool.
    group_num_blocks: list[int] = field(default_factory=list)
    _keep: list = field(default_factory=list, repr=False)  # tensors kept alive

    @property
    def mla(self) -> bool:
        return bool(self.layers) and self.layers[0][1] is None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def page_object_bytes(self) -> int:
        """Bytes of the largest group's page object (of a model of one group: its object)."""
        per_group: dict[int, int] = {}
        for i, (k, v) in enumerate(self.layers):
            g = self.groups[i] if self.groups else 0
            per_group[g] = per_group.get(g, 0) + k.bytes_per_block + (v.bytes_per_block if v else 0)
        return max(per_group.values(), default=0)

    def kv_dtypes(self) -> tuple[str, ...]:
        return _DTYPE_KV.get(self.dtype, ())

    # ---- constructors --------------------------------------------------------------------------

    @classmethod
    def from_block_tensors(cls, k: Sequence[Any], v: Optional[Sequence[Any]] = None, *,
                           device: Any = None, tokens_per_block: int = 0,
                           groups: Optional[Sequence[int]] = None) -> "KvLayout":
        """One tensor per layer for K (MLA: the latent) and, unless MLA, one for V; dimension 0
        indexes blocks and the rest of a block must be one contiguous run of bytes. ``groups``:
        each layer's KV group of a hybrid model (Namespace.groups index); layers of different
        groups may share bytes (a block is one group's at a time), layers of one group may not."""
        return _Builder(device).build(list(k), None if v is None else list(v), tokens_per_block,
                                      groups)

    @classmethod
    def from_vllm(cls, kv_caches: Union[dict, Sequence[Any]], *, mla: bool = False,
                  kv_first: bool = True, device: Any = None,
                  groups: Optional[Sequence[int]] = None) -> "KvLayout":
        """vLLM's per-layer KV caches (``register_kv_caches``' dict, in layer order, or a list).

        ``kv_first`` True: ``[2, num_blocks, block_size, ...]`` (FlashAttention and most
        backends); False: ``[num_blocks, 2, block_size, ...]`` (FlashInfer). ``mla``:
        ``[num_blocks, block_size, latent]``. ``groups``: as from_block_tensors (vLLM's hybrid
        allocator gives each group's layers views of the same tensors).
        """
        tensors = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches)
        if not tensors:
            raise ValueError("kv_caches: empty")
        if mla:
            return cls.from_block_tensors(tensors, None, device=device,
                                          tokens_per_block=_dim(tensors[0], 1, "kv_caches[0]"),
                                          groups=groups)
        ks, vs = [], []
        for i, t in enumerate(tensors):
            kv_dim = 0 if kv_first else 1
            if t.dim() < 3 or t.shape[kv_dim] != 2:
                raise ValueError(f"kv_caches[{i}]: shape {tuple(t.shape)} has no K/V dimension of "
                                 f"size 2 at dim {kv_dim}")
            ks.append(t.select(kv_dim, 0))
            vs.append(t.select(kv_dim, 1))
        return cls.from_block_tensors(ks, vs, device=device,
                                      tokens_per_block=_dim(ks[0], 1, "kv_caches[0]"),
                                      groups=groups)

    @classmethod
    def from_vllm_blocks(cls, kv_caches: Union[dict, Sequence[Any]], *, mla: bool = False,
                         num_blocks: Optional[int] = None, device: Any = None,
                         groups: Optional[Sequence[int]] = None
                         ) -> tuple["KvLayout", list[int]]:
        """vLLM >= 0.33's unified per-layer views ``[B, H, N, C]`` (RFC #42082): K and V side by
        side in the last dim (``C = head_size + head_size_v``), every layer a view of one
        allocation in any block-compact ``KVCacheLayout``; MLA ``[B, 1, N, latent]``.

        K and V of a block interleave per (token, head), so the daemon cannot address them
        apart: each layer's block bytes are registered split at their midpoint, the first half
        as "K" and the second as "V" (MLA: all of them as the latent). The daemon moves bytes
        only, so pages stay consistent as long as every engine of a namespace registers the
        same physical layout; the integration folds the layout's name into ``model_revision``.

        ``num_blocks``: the manager's block count when kernel-block splitting made dim 0 a
        multiple of it (vLLM's ``group_kernel_blocks``). Layers that alias one view (cross-layer
        KV sharing) are registered once. ``groups``: each input layer's KV group of a hybrid
        model (vLLM's hybrid allocator gives every group views of the same bytes from offset 0:
        equal views of different groups are different layers). Returns the layout and, per
        input layer, the index of its registered layer (what ``Op.wait_layer`` takes).
        """
        tensors = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches)
        if not tensors:
            raise ValueError("kv_caches: empty")
        if groups is not None and len(groups) != len(tensors):
            raise ValueError(f"groups: {len(groups)} entries for {len(tensors)} layers")
        unique: dict[tuple, int] = {}
        flats: list[Any] = []
        flat_groups: list[int] = []
        index: list[int] = []
        tokens_per_block = 0
        for i, t in enumerate(tensors):
            if t.dim() != 4:
                raise ValueError(f"kv_caches[{i}]: shape {tuple(t.shape)}: expected vLLM's "
                                 "[blocks, heads, tokens, content] view")
            if num_blocks and int(t.shape[0]) != num_blocks:
                if int(t.shape[0]) % num_blocks:
                    raise ValueError(f"kv_caches[{i}]: {t.shape[0]} kernel blocks are not a "
                                     f"multiple of num_blocks={num_blocks}")
                t = t.unflatten(0, (num_blocks, -1))  # [B, ratio, H, N, C]
            group = int(groups[i]) if groups is not None else 0
            ident = (group, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if ident not in unique:
                unique[ident] = len(flats)
                flats.append(_flat_blocks(t, f"kv_caches[{i}]"))
                flat_groups.append(group)
                tokens_per_block = int(t.shape[-2]) * (int(t.shape[1]) if t.dim() == 5 else 1)
            index.append(unique[ident])
        g = flat_groups if groups is not None else None
        if mla:
            layout = cls.from_block_tensors(flats, None, device=device,
                                            tokens_per_block=tokens_per_block, groups=g)
            return layout, index
        ks, vs = [], []
        for f in flats:
            per_block = int(f.shape[1])
            if per_block % 2:
                raise ValueError(f"kv_caches: {per_block} elements per block cannot be split "
                                 "into equal K and V halves")
            ks.append(f[:, :per_block // 2])
            vs.append(f[:, per_block // 2:])
        return cls.from_block_tensors(ks, vs, device=device, tokens_per_block=tokens_per_block,
                                      groups=g), index

    @classmethod
    def from_sglang(cls, k_buffers: Sequence[Any], v_buffers: Optional[Sequence[Any]],
                    page_size: int, *, device: Any = None) -> "KvLayout":
        """SGLang's token-major per-layer buffers; block b is page b (token slots
        ``[b * page_size, (b + 1) * page_size)``). ``v_buffers`` None: MLA ``kv_buffer``."""
        if page_size <= 0:
            raise ValueError(f"page_size: {page_size} must be > 0")

        def paged(bufs: Sequence[Any], what: str) -> list:
            out = []
            for i, t in enumerate(bufs):
                if t.dim() < 2:
                    raise ValueError(f"{what}[{i}]: shape {tuple(t.shape)}: expected [tokens, ...]")
                pages = t.shape[0] // page_size
                if pages == 0:
                    raise ValueError(f"{what}[{i}]: {t.shape[0]} token slots < page_size {page_size}")
                out.append(t[: pages * page_size].unflatten(0, (pages, page_size)))
            return out

        ks = paged(k_buffers, "k_buffers")
        vs = None if v_buffers is None else paged(v_buffers, "v_buffers")
        return cls.from_block_tensors(ks, vs, device=device, tokens_per_block=page_size)

    # ---- C structures --------------------------------------------------------------------------

    def fill(self, reg: N.Registration, keep: list) -> None:
        """Fills the layout fields of a kvc_registration; `keep` holds what its pointers use."""
        import ctypes

        regions = (N.Region * len(self.regions))()
        for i, r in enumerate(self.regions):
            if isinstance(r.handle, str):
                name = r.handle.encode()
                keep.append(name)
                regions[i].sim_shm_name = name
            else:
                h = (ctypes.c_uint8 * 64).from_buffer_copy(r.handle)
                keep.append(h)
                regions[i].cuda_ipc_handle = ctypes.cast(h, ctypes.POINTER(ctypes.c_uint8))
            regions[i].offset = r.offset
            regions[i].size = r.size
        layers = (N.Layer * len(self.layers))()
        for i, (k, v) in enumerate(self.layers):
            layers[i].k = N.Buffer(k.region, k.offset, k.block_stride, k.bytes_per_block)
            if v is not None:
                layers[i].v = N.Buffer(v.region, v.offset, v.block_stride, v.bytes_per_block)
                layers[i].has_v = 1
            layers[i].group = self.groups[i] if self.groups else 0
        keep.extend([regions, layers])
        reg.regions = regions
        reg.num_regions = len(self.regions)
        reg.layers = layers
        reg.num_layers = len(self.layers)
        reg.num_blocks = self.num_blocks
        if self.group_num_blocks:
            counts = (ctypes.c_uint32 * len(self.group_num_blocks))(*self.group_num_blocks)
            keep.append(counts)
            reg.group_num_blocks = ctypes.cast(counts, ctypes.POINTER(ctypes.c_uint32))
            reg.num_group_num_blocks = len(self.group_num_blocks)
        reg.device_kind = self.device_kind
        uuid = (ctypes.c_uint8 * 16).from_buffer_copy(self.device_uuid)
        keep.append(uuid)
        reg.device_uuid = ctypes.cast(uuid, ctypes.POINTER(ctypes.c_uint8))
        name = self.device_name.encode()
        keep.append(name)
        reg.device_name = name


def _flat_blocks(t: Any, what: str) -> Any:
    """``t`` viewed as ``[blocks, elements of a block]``; a block's elements must be one dense
    run (strides of the inner dims form a permutation of a contiguous tensor's)."""
    inner = sorted((int(st), int(sz)) for sz, st in zip(t.shape[1:], t.stride()[1:]) if sz > 1)
    expect = 1
    for st, sz in inner:
        if st != expect:
            raise ValueError(f"{what}: a block's bytes are not contiguous (strides "
                             f"{tuple(t.stride())}, shape {tuple(t.shape)}); use a block-compact "
                             "KV cache layout (LBNHC, LBHNC, BLNHC or BLHNC)")
        expect *= sz
    # With every stride positive, element 0 of a block is its lowest address.
    return t.as_strided((int(t.shape[0]), expect), (int(t.stride()[0]), 1), t.storage_offset())


def _dim(t: Any, d: int, what: str) -> int:
    if t.dim() <= d:
        raise ValueError(f"{what}: shape {tuple(t.shape)} has no dimension {d}")
    return int(t.shape[d])


class _Builder:
    """Turns per-layer block tensors into regions and buffers, checking as it goes."""

    def __init__(self, device: Any) -> None:
        self.sim = device  # a SimDevice, or None for CUDA tensors
        self.regions: list[Region] = []
        self.region_index: dict[Any, int] = {}
        self.kind: Optional[str] = None
        self.cuda_device: Optional[int] = None

    def build(self, ks: list, vs: Optional[list], tokens_per_block: int,
              groups: Optional[Sequence[int]] = None) -> KvLayout:
        if not ks:
            raise ValueError("k: no layers")
        if vs is not None and len(vs) != len(ks):
            raise ValueError(f"v: {len(vs)} layers, k has {len(ks)}")
        groups = [int(g) for g in groups] if groups is not None else [0] * len(ks)
        if len(groups) != len(ks):
            raise ValueError(f"groups: {len(groups)} entries for {len(ks)} layers")
        if sorted(set(groups)) != list(range(max(groups) + 1)):
            raise ValueError(f"groups: {sorted(set(groups))} is not 0..G-1 (each group a layer)")
        num_blocks = int(ks[0].shape[0]) if ks[0].dim() else 0
        if num_blocks <= 0:
            raise ValueError(f"k[0]: shape {tuple(ks[0].shape)} has no blocks")
        layers, keep = [], []
        # Layers of one group hold blocks of one shape and dtype; groups may differ (a recurrent
        # state's block is not an attention block).
        first_of = {}
        for i, g in enumerate(groups):
            first_of.setdefault(g, i)
        for i, kt in enumerate(ks):
            first = ks[first_of[groups[i]]]
            k = self.buffer(kt, f"k[{i}]", num_blocks, first)
            v = None if vs is None else self.buffer(vs[i], f"v[{i}]", num_blocks, first)
            layers.append((k, v))
            keep.append(kt)
            if vs is not None:
                keep.append(vs[i])
        for g in set(groups):  # a block is one group's at a time: only a group's buffers must not meet
            self.check_overlaps([lay for lay, lg in zip(layers, groups) if lg == g], num_blocks,
                                vs is not None)
        # The dtype a namespace's kv_dtype is checked against; none when groups differ (a
        # recurrent state's blocks are viewed as bytes).
        dtypes = {t.dtype for t in ks}
        layout = KvLayout(self.regions, layers, num_blocks,
                          N.DEVICE_CUDA if self.kind == "cuda" else N.DEVICE_SIM,
                          dtype=str(ks[0].dtype).replace("torch.", "") if len(dtypes) == 1 else "",
                          tokens_per_block=tokens_per_block, cuda_device=self.cuda_device,
                          groups=groups if max(groups) > 0 else [], _keep=keep)
        if self.kind == "cuda":
            layout.device_uuid, layout.device_name = _cuda_identity(self.cuda_device)
        else:
            layout.device_name = "sim"
        return layout

    def buffer(self, t: Any, what: str, num_blocks: int, first: Any) -> Buffer:
        import torch

        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != first.dtype:
            raise ValueError(f"{what}: dtype {t.dtype} differs from its group's first layer's "
                             f"{first.dtype}")
        if t.dim() < 2 or int(t.shape[0]) != num_blocks:
            raise ValueError(f"{what}: shape {tuple(t.shape)}: expected [{num_blocks}, ...] "
                             f"(num_blocks from k[0])")
        if tuple(t.shape[1:]) != tuple(first.shape[1:]):
            raise ValueError(f"{what}: block shape {tuple(t.shape[1:])} differs from its group's "
                             f"first layer's {tuple(first.shape[1:])}")
        es = t.element_size()
        inner = [(int(st), int(sz)) for sz, st in zip(t.shape[1:], t.stride()[1:]) if sz > 1]
        inner.sort()
        expect = 1
        for st, sz in inner:
            if st != expect:
                raise ValueError(f"{what}: a block's bytes are not contiguous (strides "
                                 f"{tuple(t.stride())}, shape {tuple(t.shape)})")
            expect *= sz
        bytes_per_block = expect * es
        block_stride = int(t.stride()[0]) * es if num_blocks > 1 else bytes_per_block
        if block_stride < bytes_per_block:
            raise ValueError(f"{what}: blocks overlap (block stride {block_stride} B < "
                             f"{bytes_per_block} B per block)")
        region, offset = self.region_of(t, what, (num_blocks - 1) * block_stride + bytes_per_block)
        return Buffer(region, offset, block_stride, bytes_per_block)

    def region(self, key: tuple, make: Any) -> int:
        """The index of the region `key` names, added from ``make()`` the first time."""
        if key not in self.region_index:
            self.region_index[key] = len(self.regions)
            self.regions.append(make())
        return self.region_index[key]

    def region_of(self, t: Any, what: str, extent: int) -> tuple[int, int]:
        """(region index, offset of t's first byte in the region); adds the region."""
        if t.device.type == "cuda":
            if self.kind == "sim":
                raise ValueError(f"{what}: on {t.device}, earlier tensors are sim (CPU) tensors")
            self.kind = "cuda"
            if self.cuda_device is None:
                self.cuda_device = t.device.index
            elif t.device.index != self.cuda_device:
                raise ValueError(f"{what}: on {t.device}, earlier tensors on cuda:"
                                 f"{self.cuda_device}")
            storage = t.untyped_storage()
            base = storage.data_ptr()

            def cuda_region() -> Region:
                # (device, handle, storage bytes, storage offset in the allocation, ...): the
                # handle names the caching allocator's block (cudaMalloc base), so the region
                # starts at the storage's offset inside it (torch/multiprocessing/reductions.py).
                shared = storage._share_cuda_()
                return Region(cuda_ipc_mem_handle(bytes(shared[1]), what), int(shared[3]),
                              int(shared[2]))

            idx = self.region(("cuda", base), cuda_region)
            off = t.data_ptr() - base
        elif t.device.type == "cpu":
            if self.kind == "cuda":
                raise ValueError(f"{what}: a CPU tensor, earlier tensors are on cuda")
            self.kind = "sim"
            if self.sim is None:
                # Plain host memory of this process (vLLM's CPU worker allocates its KV cache with
                # torch): the daemon copies straight from and to it (process_vm_readv/writev on
                # this process, the only one it lets this engine name): "/proc/<pid>/mem", the
                # offset being the storage's address (docs/api.md, "Process memory").
                storage = t.untyped_storage()
                base = storage.data_ptr()
                idx = self.region(("process", base), lambda: Region(
                    f"/proc/{os.getpid()}/mem", base, storage.nbytes()))
                off = t.data_ptr() - base
            else:
                mem = self.sim.find(t.data_ptr(), extent)
                if mem is None:
                    raise ValueError(f"{what}: its {extent} bytes are not inside one "
                                     "shared-memory object of the SimDevice (allocate it with "
                                     "SimDevice.empty, or pass no device to register this "
                                     "process's own memory)")
                idx = self.region(("sim", mem.name), lambda: Region(mem.name, 0, mem.nbytes))
                off = t.data_ptr() - mem.address
        else:
            raise ValueError(f"{what}: device {t.device} is neither cuda nor a sim (CPU) tensor")
        region = self.regions[idx]
        if off < 0 or off + extent > region.size:
            raise ValueError(f"{what}: bytes [{off}, {off + extent}) run past its allocation "
                             f"({region.size} bytes)")
        return idx, off

    @staticmethod
    def check_overlaps(layers: list, num_blocks: int, has_v: bool) -> None:
        bufs = []
        for i, (k, v) in enumerate(layers):
            bufs.append((f"k[{i}]", k))
            if v is not None:
                bufs.append((f"v[{i}]", v))
        by_region: dict[int, list] = {}
        for name, b in bufs:
            by_region.setdefault(b.region, []).append((b.span(num_blocks), name, b))
        for entries in by_region.values():
            entries.sort(key=lambda e: e[0])
            for (sa, na, a), (sb, nb, b) in zip(entries, entries[1:]):
                if sb[0] >= sa[1]:
                    continue
                # Spans overlap: fine only when blocks interleave without sharing a byte (vLLM's
                # FlashInfer layout puts K and V of a block side by side).
                if a.block_stride == b.block_stride and _disjoint_mod(a, b):
                    continue
                raise ValueError(f"{nb}: overlaps {na} (buffers share bytes)")


def _disjoint_mod(a: Buffer, b: Buffer) -> bool:
    s = a.block_stride
    ra, rb = a.offset % s, b.offset % s
    ea, eb = ra + a.bytes_per_block, rb + b.bytes_per_block
    for shift in (-s, 0, s):
        if rb + shift < ea and ra < eb + shift:
            return False
    return True


# torch's shareable handle (c10/cuda/CUDACachingAllocator.cpp, ``shareIpcHandle``): a version
# byte (2 from torch 2.5 to 2.12, 3 from 2.13 on), a type byte, then the type's payload. Type 'c'
# is a cudaMalloc block, whose payload is the 64-byte cudaIpcMemHandle_t of the block's base;
# type 'e' is an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), exported
# as file descriptors of cuMem allocations, which cudaIpcOpenMemHandle cannot open. Older torch
# returned the bare 64-byte handle.
_IPC_HANDLE_BYTES = 64
_SHAREABLE_VERSIONS = (2, 3)
_SHAREABLE_CUDA_MALLOC = ord("c")
_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")


def cuda_ipc_mem_handle(shared: bytes, what: str = "tensor") -> bytes:
    """The cudaIpcMemHandle_t in the handle torch's ``UntypedStorage._share_cuda_()`` returns.
    Raises ValueError, naming ``what``, for memory the daemon cannot open by CUDA IPC."""
    if len(shared) == _IPC_HANDLE_BYTES:
        return shared
    if len(shared) < 2 or shared[0] not in _SHAREABLE_VERSIONS:
        raise ValueError(f"{what}: torch's CUDA IPC handle ({len(shared)} bytes, version byte "
                         f"{shared[0] if shared else None}) is of no format kvcellar knows "
                         f"(versions {list(_SHAREABLE_VERSIONS)})")
    kind = shared[1]
    if kind == _SHAREABLE_EXPANDABLE_SEGMENT:
        raise ValueError(f"{what}: allocated in an expandable segment "
                         "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which CUDA IPC "
                         "cannot share: allocate the KV cache with expandable_segments:False")
    if kind != _SHAREABLE_CUDA_MALLOC or len(shared) != 2 + _IPC_HANDLE_BYTES:
        raise ValueError(f"{what}: torch's CUDA IPC handle of type {chr(kind)!r} and "
                         f"{len(shared)} bytes: expected type 'c' (cudaMalloc) and "
                         f"{2 + _IPC_HANDLE_BYTES} bytes")
    return shared[2:]


def _cuda_identity(index: Optional[int]) -> tuple[bytes, str]:
    import uuid as uuidlib

    import torch

    props = torch.cuda.get_device_properties(index or 0)
    raw = getattr(props, "uuid", None)
    text = str(raw) if raw is not None else ""
    try:
        u = uuidlib.UUID(text.replace("GPU-", "")).bytes
    except ValueError:
        u = b"\0" * 16
    return u, props.name
