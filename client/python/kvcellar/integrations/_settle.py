"""Engine memory the daemon may still be copying is handed back only once the ops naming it end.

A Load or Backup that was not seen to end (its wait timed out, or the reply to its submission was
lost) may still run in the daemon: a Load still writes the blocks it names, a Backup still reads
them, and neither can be cancelled (docs/api.md: "Backup block reuse"; Release cancels
prefetches only). Memory handed back to a framework before then can be overwritten under a
Backup (a torn page, stored and served to every engine) or by a late Load (another object's
bytes in a reused buffer). ``settle`` waits for the end; ``_arena.SlotArena`` keeps an
adapter's own slots out of use until it comes.

An op has ended when the client says it is terminal. The native client decides that with the
daemon: an op the daemon ended, or one of a session the daemon has ended (restarted, or the
lease of a session whose daemon stopped answering ran out: a lost submission is pending until
then). So the wait is bounded by the session's lease when the daemon is gone, and lasts as long
as the op when it is merely slow.
"""

from __future__ import annotations

import logging
import time
from typing import List, Sequence

from ..client import Op, OpStatus, Session

log = logging.getLogger(__name__)

_POLL_MS = 50


def unreachable(reason: str) -> bool:
    """The daemon could not be asked (down or restarting), as opposed to an op still running. A
    call that ran out of time says nothing of the kind: the daemon may be alive and busy."""
    if "DEADLINE_EXCEEDED" in reason.upper().replace(" ", "_"):
        return False
    return reason.startswith("unavailable") or reason.startswith("error")


def may_run(op: Op) -> bool:
    """Whether the daemon may have taken ``op``: accepted, or submitted with its reply lost."""
    return bool(op.ok or op.op_id or op.c_op.generation)


def ended(sts: Sequence[OpStatus]) -> bool:
    return all(st.terminal for st in sts)


def settle(session: Session, ops: Sequence[Op], log_every_ms: int, what: str
           ) -> List[OpStatus]:
    """Blocks until every op of ``ops`` has ended; their final statuses. The memory they name
    is not the engine's to reuse before then, however long the daemon takes (logged every
    ``log_every_ms``)."""
    start = last_log = time.monotonic()
    while True:
        sts = session.wait(list(ops), _POLL_MS)
        if ended(sts):
            return sts
        now = time.monotonic()
        if now - last_log >= max(log_every_ms, 1000) / 1000:
            last_log = now
            log.warning("kvcellar: %s: waiting %.1f s for the daemon to end ops that still name "
                        "the engine's memory (%s)", what, now - start,
                        "; ".join(sorted({st.reason for st in sts if not st.terminal})))
