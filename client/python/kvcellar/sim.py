"""The sim device: engine KV memory and completion signals in POSIX shared memory.

On a GPU an engine's KV cache is device memory the daemon maps through CUDA IPC. On the sim
device it lives in shared-memory objects that the daemon maps by name, and tensors are CPU
tensors created over those objects (``SimDevice.empty``). The same layout description, the same
RPCs and the same per-layer signals apply; only the copy engine differs. Tests and machines
without a GPU run engines this way.

Each object is owned by the Python object that created it: ``close()`` (or garbage collection)
unmaps and unlinks it. A daemon that mapped it keeps its mapping until the session ends.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np

from . import _native as N


def unique_name(tag: str = "py") -> str:
    """A shared-memory name no other live process uses: "/kvc-<tag>-<pid>-<n>-<random>"."""
    buf = ctypes.create_string_buffer(256)
    rc = N.lib.kvc_sim_unique_name(tag.encode(), buf, len(buf))
    if rc != N.OK:
        raise ValueError(f"unique_name: {N.last_error()}")
    return buf.value.decode()


class SimMemory:
    """One shared-memory object, zero-filled, mapped read-write in this process."""

    def __init__(self, nbytes: int, name: Optional[str] = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes: {nbytes} must be > 0")
        self._handle = ctypes.c_void_p()
        name = name or unique_name("mem")
        rc = N.lib.kvc_sim_memory_create(name.encode(), nbytes, ctypes.byref(self._handle))
        if rc != N.OK:
            raise OSError(f"SimMemory({name!r}, {nbytes}): {N.last_error()}")
        self.name = name
        self.nbytes = nbytes
        self.address = int(N.lib.kvc_sim_memory_data(self._handle))
        self._array = np.ctypeslib.as_array(
            (ctypes.c_uint8 * nbytes).from_address(self.address))

    def array(self) -> np.ndarray:
        """The whole object as a uint8 NumPy array (shares the memory)."""
        return self._array

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    def close(self) -> None:
        if self._handle:
            N.lib.kvc_sim_memory_close(self._handle)
            self._handle = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class SimDevice:
    """Allocates an engine's KV tensors in shared memory the daemon can map.

    ``empty(shape, dtype)`` returns a CPU torch tensor over a new shared-memory object; keep the
    SimDevice alive as long as the tensors (it owns the objects). ``find(address, nbytes)``
    names the object holding a tensor's bytes, which is how a layout is derived from tensors.
    """

    def __init__(self, tag: str = "kv") -> None:
        self.tag = tag
        self.memories: list[SimMemory] = []

    def alloc(self, nbytes: int) -> SimMemory:
        mem = SimMemory(nbytes, unique_name(self.tag))
        self.memories.append(mem)
        return mem

    def empty(self, shape: Sequence[int], dtype) -> "object":
        """A zero-filled CPU tensor of ``shape`` and torch ``dtype`` in a new shm object."""
        import torch

        numel = int(np.prod(shape)) if len(shape) else 1
        itemsize = torch.empty((), dtype=dtype).element_size()
        mem = self.alloc(max(numel * itemsize, 1))
        flat = torch.from_numpy(mem.array()[: numel * itemsize])
        return flat.view(dtype).view(*shape)

    def find(self, address: int, nbytes: int) -> Optional[SimMemory]:
        for mem in self.memories:
            if mem.contains(address, nbytes):
                return mem
        return None

    def close(self) -> None:
        for mem in self.memories:
            mem.close()
        self.memories.clear()


class SimSignals:
    """The KVCSIG01 completion channel of a sim engine (docs/api.md, "SIM: shared-memory
    counters"): the daemon stores per-layer Load signals there, the engine its Backup ready
    tokens."""

    def __init__(self, num_load_slots: int, num_layers: int, num_ready_slots: int,
                 name: Optional[str] = None) -> None:
        self._handle = ctypes.c_void_p()
        name = name or unique_name("sig")
        rc = N.lib.kvc_sim_signals_create(name.encode(), num_load_slots, num_layers,
                                          num_ready_slots, ctypes.byref(self._handle))
        if rc != N.OK:
            raise ValueError(f"SimSignals: {N.last_error()}")
        self.name = name
        self.size = int(N.lib.kvc_sim_signals_size(self._handle))
        self.num_load_slots = num_load_slots
        self.num_layers = num_layers
        self.num_ready_slots = num_ready_slots
        self._tokens = [0] * num_ready_slots

    def next_token(self, slot: int) -> int:
        """A ready token larger than every earlier one of ``slot``."""
        self._tokens[slot] += 1
        return self._tokens[slot]

    def publish_ready(self, slot: int, token: int) -> None:
        rc = N.lib.kvc_sim_signals_publish_ready(self._handle, slot, token)
        if rc != N.OK:
            raise ValueError(f"publish_ready: {N.last_error()}")

    def close(self) -> None:
        if self._handle:
            N.lib.kvc_sim_signals_close(self._handle)
            self._handle = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
