"""An adapter's own slots for the objects its framework hands over at addresses of the
framework's (LMCache's chunks, AIBrix's blocks): the objects cannot be registered where they
are, so they pass through slots the daemon can reach.
"""

from __future__ import annotations

import os
import threading
import time
from typing import List, Optional, Sequence

import torch

from .. import _native as N
from ..client import Op, OpStatus, Session
from ..layout import Buffer, KvLayout, Region
from ._settle import ended, may_run


class SlotArena:
    """``num_slots`` slots of ``slot_bytes`` bytes in this process's memory, registered once
    with the daemon as a KvLayout whose block b is slot b ("/proc/<pid>/mem": the daemon copies
    with process_vm_readv/writev, docs/api.md "Process memory"). Thread-safe; a slot belongs to one operation from ``take`` to ``give``.

    A slot whose op the adapter stopped waiting for (``outcome``) stays out of use until the
    daemon has ended the op (_settle: it may still read or write the slot); ``take`` takes such
    slots back once their ops have ended."""

    def __init__(self, slot_bytes: int, num_slots: int, pin: bool = False) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.tensor = torch.zeros((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin)
        self.base = int(self.tensor.data_ptr())
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: list = []  # (ops, slots): ops not seen to end, and the slots they name
        self._held_slots: set = set()
        self._cv = threading.Condition()

    def layout(self, name: str, tokens_per_block: int = 0) -> KvLayout:
        """One buffer, block b = slot b. No dtype: a slot holds an object's bytes, whatever the
        namespace's KV dtype (``from_block_tensors`` would call them uint8 KV)."""
        region = Region(f"/proc/{os.getpid()}/mem", self.base, self.slot_bytes * self.num_slots)
        buf = Buffer(0, 0, self.slot_bytes, self.slot_bytes)
        return KvLayout([region], [(buf, None)], self.num_slots, N.DEVICE_SIM, device_name=name,
                        tokens_per_block=tokens_per_block, _keep=[self.tensor])

    def address(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def take(self, n: int, session: Optional[Session] = None, wait_s: float = 0.0) -> List[int]:
        """Up to ``n`` free slots (fewer, or none, when the arena is short), waiting up to
        ``wait_s`` for one; with ``session``, the held slots whose ops have ended are free
        again first."""
        deadline = time.monotonic() + wait_s
        while True:
            if session is not None:
                self._reap(session)
            with self._cv:
                if self._free:
                    k = min(n, len(self._free))
                    out = self._free[len(self._free) - k:]
                    del self._free[len(self._free) - k:]
                    return out[::-1]
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cv.wait(min(left, 0.05))

    def give(self, slots: Sequence[int]) -> None:
        """Back to the free list, but for the slots held for an op that may still run."""
        with self._cv:
            self._free.extend(s for s in slots if s not in self._held_slots)
            self._cv.notify_all()

    def outcome(self, op: Op, slots: Sequence[int], timeout_ms: int) -> Optional[OpStatus]:
        """``op``'s status once it has ended within ``timeout_ms``; else None, and ``slots`` are
        held (``give`` skips them) until the daemon has ended it."""
        st = op.wait(timeout_ms) if op.ok else None
        if st is not None and st.terminal:
            return st
        if may_run(op):
            with self._cv:
                self._held.append(([op], list(slots)))
                self._held_slots.update(slots)
        return None

    @property
    def free(self) -> int:
        with self._cv:
            return len(self._free)

    @property
    def held(self) -> int:
        with self._cv:
            return len(self._held_slots)

    def _reap(self, session: Session) -> None:
        with self._cv:
            held = list(self._held)
        if not held:
            return
        over = [entry for entry in held if ended(session.wait(entry[0], 0))]
        if not over:
            return
        with self._cv:
            for ops, slots in over:
                self._held.remove((ops, slots))
                self._held_slots.difference_update(slots)
                self._free.extend(slots)
            self._cv.notify_all()
