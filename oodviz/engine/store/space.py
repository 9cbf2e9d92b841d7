"""Free disk space: the pre-flight check before extraction, and the error a full disk turns into.

:func:`check_free_space` compares the bytes a store will take with the space free under its root
(a message when it does not fit, ``None`` when it does); :class:`DiskFullError` is what
:class:`~oodviz.engine.store.StoreWriter` raises, its temporary directory removed, when a write
fails with ``ENOSPC`` (no space left) or ``EDQUOT`` (quota exceeded).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from oodviz.models.memory import format_bytes

#: The errno values that mean "the disk is full" to the writer.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Head room the pre-flight check asks for beyond an estimate: at least this many bytes ...
MARGIN_BYTES = 16 << 20
#: ... or this fraction of the estimate, whichever is larger (estimates leave out headers, meta.json).
MARGIN_FRACTION = 0.05


class DiskFullError(OSError):
    """Not enough disk space for a feature store; the message says how much was needed and how much is free."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


def free_bytes(root) -> int:
    """Bytes free to this user on the file system that holds ``root`` (or its nearest existing parent)."""
    path = Path(root).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_full_message(root, needed_bytes: int) -> str:
    """``"disk full: needed ~X, Y free under <root>"`` with the free space as it is now."""
    return (
        f"disk full: needed ~{format_bytes(needed_bytes)}, {format_bytes(free_bytes(root))} free under {root}; "
        "free some space (old runs, unused feature stores: oodviz store list) or choose another runs root"
    )


def margin_for(estimated_bytes: int) -> int:
    """The head room asked for beyond an estimate of ``estimated_bytes``: ``max(MARGIN_BYTES, MARGIN_FRACTION x
    estimated_bytes)``."""
    return max(MARGIN_BYTES, int(MARGIN_FRACTION * estimated_bytes))


def check_free_space(root, needed_bytes: int, margin_bytes: int | None = None) -> str | None:
    """A :func:`disk_full_message` when less than ``needed_bytes + margin`` is free under ``root``, else ``None``.

    ``margin_bytes`` defaults to :func:`margin_for` ``(needed_bytes)``; pass ``0`` for exact sizes (or a need
    that has its margin already).
    """
    needed_bytes = int(needed_bytes)
    if needed_bytes < 0:
        raise ValueError(f"needed_bytes must be at least 0, got {needed_bytes}")
    if margin_bytes is None:
        margin_bytes = margin_for(needed_bytes)
    if free_bytes(root) < needed_bytes + margin_bytes:
        return disk_full_message(root, needed_bytes + margin_bytes)
    return None


def is_disk_full(error: BaseException) -> bool:
    """True for an ``OSError`` that means no space is left (``ENOSPC``, ``EDQUOT``)."""
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS
