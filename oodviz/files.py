"""Files that readers never see half-written, and JSON objects read without raising: what every layer that writes
a result file shares (run directories, saved detectors, result tables, projections, reports).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)
#: the mode of an ordinary file under this process's umask (``mkstemp`` alone creates 0600)
FILE_MODE = 0o666 & ~_UMASK


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` (its directory must exist) so that readers see the old or the new file,
    never a part; on any error (a full disk) the temporary file is removed and the error raised."""
    path = Path(path)
    # no mkdir: a write into a run directory that was deleted meanwhile must fail, not re-create it
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json_object(path: Path) -> tuple[dict, str | None]:
    """``(the JSON object in path, None)``, or ``({}, what is wrong)`` when the file is missing, unreadable,
    not UTF-8 JSON or not an object. Never raises."""
    name = Path(path).name
    try:
        value = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return {}, f"{name} is missing"
    except OSError as error:
        return {}, f"{name} cannot be read ({error.strerror})"
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, nesting too deep
        return {}, f"{name} is not valid JSON"
    if not isinstance(value, dict):
        return {}, f"{name} holds a {type(value).__name__}, not an object"
    return value, None


def write_json(path: Path, value) -> None:
    """``value`` as indented JSON, written with :func:`write_atomic` (``str()`` for what JSON cannot hold)."""
    write_atomic(path, json.dumps(value, indent=2, default=str))
