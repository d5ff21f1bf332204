"""ctypes declarations of libkvcellar-client's C ABI (client/kvcellar_client_c.h).

This module is the only place that knows the C structures. It loads the native library once per
process (the package's one piece of global state) from, in order: the ``KVCELLAR_CLIENT_LIBRARY``
environment variable, the copy bundled in the installed package (``kvcellar/_lib``), and a
development build tree (``build/lib`` of the repository this file sits in).

Why ctypes over the C ABI rather than a compiled extension (nanobind over the C++ client): one
native library serves every Python (the pyenv build, Debian's, an engine's own), with no Python
ABI tag to rebuild for; the C ABI already carries the failure contract (outputs always filled, a
status saying why a call missed); and every array crosses as one pointer, so the per-call cost
does not grow with the batch size. What it is: client/python/bench/bench_calls.py times each call
beside the C++ client's, the two taking turns, so that each call starts on caches the other side
has just used, much as an engine's step leaves them. There (2048-page batches, a shared 2-core
machine) the package adds about 20 us to a Match by keys, 40-50 us to one by tokens and 40-130 us
to a Load or Backup with its wait: CPython running the per-call lines below with cold caches.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import (POINTER, Structure, c_char_p, c_int, c_size_t, c_uint8, c_uint32, c_uint64,
                    c_void_p)
from pathlib import Path

KEY_BYTES = 32

# Status codes (KVC_*).
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_UNAVAILABLE = 2
ERR_REJECTED = 3
ERR_REFUSED = 4
ERR_INTERNAL = 5
ERR_OP_FAILED = 6

STATUS_NAMES = {
    OK: "ok",
    ERR_INVALID_ARGUMENT: "invalid_argument",
    ERR_UNAVAILABLE: "unavailable",
    ERR_REJECTED: "rejected",
    ERR_REFUSED: "refused",
    ERR_INTERNAL: "internal",
    ERR_OP_FAILED: "op_failed",
}

LAYOUT_MHA = 0
LAYOUT_MLA = 1
GROUP_FULL, GROUP_WINDOW, GROUP_STATE = 0, 1, 2
NO_BLOCK = 0xFFFFFFFF  # a hybrid's blocks: this group's object of this page is not moved
DEVICE_CUDA = 1
DEVICE_SIM = 2


class ClientOptions(Structure):
    _fields_ = [
        ("addr", c_char_p),
        ("rpc_timeout_ms", c_uint32),
        ("register_timeout_ms", c_uint32),
        ("backoff_min_ms", c_uint32),
        ("backoff_max_ms", c_uint32),
        ("heartbeat", c_int),
        ("heartbeat_interval_ms", c_uint32),
        ("tls_ca_file", c_char_p),
        ("tls_cert_file", c_char_p),
        ("tls_key_file", c_char_p),
        ("tls_server_name", c_char_p),
    ]


class ClientStats(Structure):
    _fields_ = [(name, c_uint64) for name in (
        "rpcs_ok", "rpcs_failed", "rpcs_unavailable", "rpcs_deadline_exceeded",
        "rpcs_unimplemented", "degraded_calls", "match_calls", "match_pages",
        "match_l2_hit_pages", "registrations", "reregistrations", "registration_failures",
        "sessions_lost", "heartbeats_ok", "heartbeats_failed", "ns_digest_mismatches",
        "ops_failed_session_lost", "uncertain_submissions")]


class KvGroup(Structure):
    _fields_ = [("kind", c_uint32), ("window_tokens", c_uint32)]


class Namespace(Structure):
    _fields_ = [
        ("tenant", c_char_p),
        ("model_id", c_char_p),
        ("model_revision", c_char_p),
        ("kv_dtype", c_char_p),
        ("page_size", c_uint32),
        ("layout", c_uint32),
        ("tp_size", c_uint32),
        ("opaque_keys", c_int),
        ("groups", POINTER(KvGroup)),
        ("num_groups", c_size_t),
    ]


class Region(Structure):
    _fields_ = [
        ("sim_shm_name", c_char_p),
        ("cuda_ipc_handle", POINTER(c_uint8)),
        ("offset", c_uint64),
        ("size", c_uint64),
    ]


class Buffer(Structure):
    _fields_ = [
        ("region", c_uint32),
        ("offset", c_uint64),
        ("block_stride", c_uint64),
        ("bytes_per_block", c_uint64),
    ]


class Layer(Structure):
    _fields_ = [("k", Buffer), ("v", Buffer), ("has_v", c_int), ("group", c_uint32)]


class Registration(Structure):
    _fields_ = [
        ("instance_id", c_char_p),
        ("rank", c_uint32),
        ("scheduler", c_int),
        ("ns", Namespace),
        ("device_kind", c_uint32),
        ("device_uuid", POINTER(c_uint8)),
        ("device_name", c_char_p),
        ("regions", POINTER(Region)),
        ("num_regions", c_size_t),
        ("layers", POINTER(Layer)),
        ("num_layers", c_size_t),
        ("num_blocks", c_uint32),
        ("num_load_slots", c_uint32),
        ("num_ready_slots", c_uint32),
        ("sim_signal_shm_name", c_char_p),
        ("sim_signal_size", c_uint64),
        ("cuda_load_event_handles", POINTER(c_uint8)),
        ("cuda_ready_event_handles", POINTER(c_uint8)),
        ("replace_existing", c_int),
        ("engine_name", c_char_p),
        ("group_num_blocks", POINTER(c_uint32)),
        ("num_group_num_blocks", c_size_t),
    ]


class SessionInfo(Structure):
    _fields_ = [
        ("session_id", c_uint64),
        ("generation", c_uint64),
        ("daemon_epoch", c_uint64),
        ("lease_ms", c_uint32),
        ("heartbeat_interval_ms", c_uint32),
        ("shard_index", c_uint32),
        ("num_shards", c_uint32),
        ("is_shard_writer", c_int),
        ("page_object_bytes", c_uint64),
        ("state", c_int),
        ("ns_digest", c_uint8 * KEY_BYTES),
        ("max_batch_pages", c_uint32),
        ("max_batch_sequences", c_uint32),
        ("num_l3_tiers", c_uint32),
        ("page_tokens", c_int),
    ]


class Op(Structure):
    _fields_ = [("op_id", c_uint64), ("generation", c_uint64)]


# The structures of the per-step calls (match, load, backup, wait) declare their array pointers as
# c_void_p, which has the C pointer's size and passing: the package stores a NumPy array's address
# there as a plain int (``address(arr)``, below) instead of building a typed pointer object with
# ctypes.cast on every call, which costs microseconds per array in an engine's step.
class MatchSeq(Structure):
    _fields_ = [
        ("tokens", c_void_p),  # const uint32_t*
        ("num_tokens", c_size_t),
        ("keys", c_void_p),  # const uint8_t*, num_keys * 32 bytes
        ("num_keys", c_size_t),
        ("num_computed_pages", c_uint32),
        ("l2_hit_pages", c_uint32),
        ("l3_hit_pages", c_uint32),
        ("total_pages", c_uint32),
        ("pin_id", c_uint64),
    ]


class MatchOptions(Structure):
    _fields_ = [
        ("pin", c_int),
        ("pin_lease_ms", c_uint32),
        ("prefetch_policy", c_uint32),
        ("prefetch_timeout_ms", c_uint32),
        ("step_id", c_uint64),
        ("l3_lookup_timeout_ms", c_uint32),
    ]


class LoadSeq(Structure):
    _fields_ = [
        ("keys", c_void_p),  # const uint8_t*
        ("blocks", c_void_p),  # const uint32_t*
        ("num_pages", c_size_t),
        ("pin_id", c_uint64),
        ("release_pin", c_int),
        ("leading_ok_pages", c_uint32),
        ("page_status", c_void_p),  # uint8_t*, optional
    ]


class BackupSeq(Structure):
    _fields_ = [
        ("parent_key", c_void_p),  # const uint8_t*, 32 bytes, or NULL
        ("keys", c_void_p),  # const uint8_t*
        ("blocks", c_void_p),  # const uint32_t*
        ("num_pages", c_size_t),
        ("leading_ok_pages", c_uint32),
        ("page_status", c_void_p),  # uint8_t*, optional
        ("tokens", c_void_p),  # const uint32_t*, num_pages * page_size, optional
    ]


class BackupOptions(Structure):
    _fields_ = [
        ("has_ready", c_int),
        ("ready_slot", c_uint32),
        ("ready_token", c_uint64),
        ("write_policy", c_uint32),
        ("ready_timeout_ms", c_uint32),
    ]


class OpStatus(Structure):
    _fields_ = [
        ("op", Op),
        ("state", c_int),
        ("num_sequences", c_uint32),
        ("leading_ok_pages", c_void_p),  # uint32_t*, optional
        ("leading_ok_cap", c_size_t),
    ]


_P = c_void_p  # opaque handles


def _declare(lib: ctypes.CDLL) -> None:
    def fn(name: str, restype, *argtypes) -> None:
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = list(argtypes)

    fn("kvc_last_error", c_char_p)
    fn("kvc_version", c_char_p)
    fn("kvc_client_options_init", None, POINTER(ClientOptions))
    fn("kvc_client_connect", c_int, POINTER(ClientOptions), POINTER(_P))
    fn("kvc_client_close", None, _P)
    fn("kvc_client_stats_get", c_int, _P, POINTER(ClientStats))
    fn("kvc_register", c_int, _P, POINTER(Registration), POINTER(_P))
    fn("kvc_session_close", None, _P, c_uint32)
    fn("kvc_session_info_get", c_int, _P, POINTER(SessionInfo))
    fn("kvc_session_wait_active", c_int, _P, c_uint32)
    fn("kvc_compute_keys", c_size_t, _P, POINTER(c_uint32), c_size_t, POINTER(c_uint8), c_size_t)
    fn("kvc_match", c_int, _P, POINTER(MatchSeq), c_size_t, POINTER(MatchOptions), POINTER(Op))
    fn("kvc_load", c_int, _P, POINTER(LoadSeq), c_size_t, c_int, c_uint32, POINTER(Op),
       POINTER(c_int))
    fn("kvc_backup", c_int, _P, POINTER(BackupSeq), c_size_t, POINTER(BackupOptions), POINTER(Op),
       POINTER(c_int))
    fn("kvc_wait", c_int, _P, POINTER(OpStatus), c_size_t, c_uint32, c_int)
    fn("kvc_wait_layer", c_int, _P, Op, c_uint32, c_uint32, c_uint32)
    fn("kvc_wait_load_signal", c_int, _P, Op, c_uint32, c_uint32)
    fn("kvc_release", c_int, _P, POINTER(c_uint64), c_size_t, POINTER(Op), c_size_t)
    fn("kvc_namespace_digest", c_int, POINTER(Namespace), POINTER(c_uint8))
    # parent_key, tokens, keys_out: addresses (see MatchSeq).
    fn("kvc_page_keys", c_int, POINTER(Namespace), c_void_p, c_void_p, c_size_t, c_void_p,
       c_size_t, POINTER(c_size_t))
    fn("kvc_session_keys", c_int, _P, c_void_p, c_size_t, c_void_p, c_size_t, POINTER(c_size_t))
    fn("kvc_sim_unique_name", c_int, c_char_p, c_char_p, c_size_t)
    fn("kvc_sim_memory_create", c_int, c_char_p, c_uint64, POINTER(_P))
    fn("kvc_sim_memory_data", c_void_p, _P)
    fn("kvc_sim_memory_size", c_uint64, _P)
    fn("kvc_sim_memory_name", c_char_p, _P)
    fn("kvc_sim_memory_close", None, _P)
    fn("kvc_sim_signals_create", c_int, c_char_p, c_uint32, c_uint32, c_uint32, POINTER(_P))
    fn("kvc_sim_signals_name", c_char_p, _P)
    fn("kvc_sim_signals_size", c_uint64, _P)
    fn("kvc_sim_signals_publish_ready", c_int, _P, c_uint32, c_uint64)
    fn("kvc_sim_signals_close", None, _P)


LIBRARY_NAME = "libkvcellar-client.so"


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get("KVCELLAR_CLIENT_LIBRARY")
    if env:
        out.append(Path(env))
    here = Path(__file__).resolve().parent
    out.append(here / "_lib" / LIBRARY_NAME)
    # A development checkout: client/python/kvcellar/_native.py -> <root>/build/lib.
    out.append(here.parents[2] / "build" / "lib" / LIBRARY_NAME)
    return out


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        if path.exists():
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            return lib
        tried.append(str(path))
    raise ImportError(
        "kvcellar: libkvcellar-client.so not found (tried " + ", ".join(tried) +
        "); install the package with pip, or set KVCELLAR_CLIENT_LIBRARY")


lib = _load()
LIBRARY_PATH = lib._name


def last_error() -> str:
    """The message of the calling thread's last failed kvc_* call."""
    msg = lib.kvc_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def status_reason(code: int) -> str:
    """'<status>: <message>' for a non-OK code, '' for OK."""
    if code == OK:
        return ""
    return f"{STATUS_NAMES.get(code, str(code))}: {last_error()}"


_c_char = ctypes.c_char
_addressof = ctypes.addressof


def address(arr: "numpy.ndarray") -> int:  # noqa: F821 (numpy is the caller's)
    """The address of a C-contiguous NumPy array's first byte, for the c_void_p fields above.

    Through the buffer protocol, which runs C code only. ``arr.ctypes.data`` builds a
    Python-level helper object on every call, several times slower once an engine's step has
    left the CPU caches cold (client/python/bench/bench_calls.py measures the calls that way).
    Read-only and empty arrays, which cannot export a writable buffer of a byte or more, take
    ``arr.ctypes.data``.
    """
    try:
        return _addressof(_c_char.from_buffer(arr))
    except (TypeError, ValueError, BufferError):
        return arr.ctypes.data
