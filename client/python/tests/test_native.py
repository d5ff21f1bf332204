"""The package's ctypes helpers (kvcellar/_native.py) that the per-step calls rely on."""
import numpy as np

from kvcellar import _native as N


def test_address_is_the_first_byte_of_every_kind_of_array():
    keys = np.arange(64 * 32, dtype=np.uint8).reshape(64, 32)
    assert N.address(keys) == keys.ctypes.data
    view = keys[5:]  # a view that does not start at its allocation
    assert N.address(view) == keys.ctypes.data + 5 * 32
    ro = np.frombuffer(bytes(range(64)), dtype=np.uint8)  # read-only: no writable buffer
    assert not ro.flags.writeable and N.address(ro) == ro.ctypes.data
    empty = np.zeros((0, 32), np.uint8)
    assert N.address(empty) == empty.ctypes.data
    blocks = np.arange(10, dtype=np.uint32)
    assert N.address(blocks) == blocks.ctypes.data
