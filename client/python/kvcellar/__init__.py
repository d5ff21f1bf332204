"""kvcellar: the Python client of kvcellard, the per-node KV-cache daemon.

Engines register their KV tensors (``KvLayout``), then per scheduler step ``match`` prompts,
``load`` cached pages into their blocks layer by layer and ``backup`` new ones. A cache failure
is a miss with a reason, never an exception in the engine's step.
"""

from ._native import LIBRARY_PATH, lib as _lib
from .client import (BackupSeq, Client, LoadSeq, MatchReply, MatchResult, Op, OpStatus, Session,
                     SessionInfo)
from .keys import KvGroup, Namespace, page_keys
from .layout import KvLayout
from .sim import SimDevice, SimMemory, SimSignals

__version__ = _lib.kvc_version().decode().split()[-1]

__all__ = [
    "BackupSeq", "Client", "KvGroup", "KvLayout", "LIBRARY_PATH", "LoadSeq", "MatchReply", "MatchResult",
    "Namespace", "Op", "OpStatus", "Session", "SessionInfo", "SimDevice", "SimMemory",
    "SimSignals", "page_keys",
]
