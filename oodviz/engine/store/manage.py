"""Housekeeping of a store root: who owns an unfinished directory, stale ones, removal, which runs use what.

An unfinished split is written under ``<key>.tmp-<pid>-<start>-<random>`` (:func:`scratch_name`),
``<start>`` being the writer process's start time in milliseconds as psutil reports it, so a pid
that was reused by another process is not taken for the writer (:func:`owner_alive`). Stores are
removed by renaming them to ``<key>.old-...`` first (:func:`remove_store`): a reader never sees
half a directory, and one holding memory maps keeps reading the unlinked files.

A run lists the stores of its splits in ``<run>/meta.json`` (``meta["splits"][split]["store"]``);
:func:`store_users` and :func:`stores_used_only_by` read those to say which stores a run shares.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from pathlib import Path

import psutil

from oodviz.engine.store.keys import OLD_MARK, STORE_FORMAT, TMP_MARK, StoreError, check_key
from oodviz.engine.store.reader import FeatureStore

logger = logging.getLogger("oodviz.engine")

#: Where the runs of a runs root keep their shared stores: ``<runs root>/.features``.
STORES_DIRNAME = ".features"
#: How far a process's start time may drift between two readings (psutil derives it from boot time).
START_TOLERANCE_MS = 2000
#: Run states in which a run may still open (or be about to open) a store.
ACTIVE_RUN_STATES = ("queued", "running")

_SCRATCH_NAME = re.compile(r"^(?P<key>.+)\.(?:tmp|old)-(?P<pid>\d+)(?:-(?P<start>\d+))?-(?P<token>[0-9a-f]+)$")

# Temporary directories being written by this process (never cleaned as stale, even by a
# thread of the same process running another extraction).
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()
_START_MS: list[int] = []


def process_start_ms(pid: int | None = None) -> int:
    """The start time of process ``pid`` (this one by default) in ms since the epoch, as psutil sees it."""
    if pid is None:
        if not _START_MS:
            _START_MS.append(int(psutil.Process().create_time() * 1000))
        return _START_MS[0]
    return int(psutil.Process(pid).create_time() * 1000)


def scratch_name(key: str, mark: str) -> str:
    """``<key><mark><pid>-<start ms>-<random>``: a directory name that says which process owns it."""
    return f"{key}{mark}{os.getpid()}-{process_start_ms()}-{secrets.token_hex(4)}"


def owner_alive(name: str) -> bool:
    """Whether the process that owns the directory ``name`` (a :func:`scratch_name`) is still running.

    Same pid and same start time (within :data:`START_TOLERANCE_MS`): alive. Names without a start
    time (the older ``<key>.tmp-<pid>-<random>``) fall back to the pid alone.
    """
    match = _SCRATCH_NAME.match(name)
    if match is None:
        return False
    pid = int(match.group("pid"))
    if pid <= 0:
        return False
    try:
        started = process_start_ms(pid)
    except psutil.NoSuchProcess:  # gone, or a zombie: writes nothing any more
        return False
    except psutil.Error:  # another user's process: it exists, assume it is the owner
        return True
    recorded = match.group("start")
    return recorded is None or abs(started - int(recorded)) <= START_TOLERANCE_MS


def mark_active(path: Path) -> None:
    """Say that this process is writing ``path`` (:func:`clean_stale_tmp` leaves it alone)."""
    with _ACTIVE_LOCK:
        _ACTIVE.add(str(path))


def forget_active(path: Path) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.discard(str(path))


def _is_active(path: Path) -> bool:
    with _ACTIVE_LOCK:
        return str(path) in _ACTIVE


def clean_stale_tmp(root, key: str | None = None, min_age_s: float = 60.0, max_age_s: float = 6 * 3600.0) -> list[Path]:
    """Remove unfinished store directories (``<key>.tmp-...``, ``<key>.old-...``) under ``root``.

    A directory is stale when its owner is gone (:func:`owner_alive`: no process with its pid and
    start time) and nothing in it changed for ``min_age_s`` seconds, or when nothing in it changed
    for ``max_age_s`` seconds whatever the owner says (another machine sharing the disk).
    Directories being written by this process are never removed. ``key`` limits the clean-up to
    that key. Returns the removed paths. Such directories are never opened as stores either way;
    this only frees their disk space.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    now = time.time()
    for entry in root.iterdir():
        name = entry.name
        if (TMP_MARK not in name and OLD_MARK not in name) or not entry.is_dir() or _is_active(entry):
            continue
        if key is not None and not name.startswith(f"{key}."):
            continue
        try:
            newest = max([entry.stat().st_mtime] + [p.stat().st_mtime for p in entry.iterdir()])
        except OSError:
            continue
        age = now - newest
        if (age >= min_age_s and not owner_alive(name)) or age >= max_age_s:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                logger.info("removed stale unfinished store %s", entry)
                removed.append(entry)
    return removed


def remove_store(root, key: str) -> Path:
    """Delete the store ``<root>/<key>`` (renamed aside first, then removed); returns the path it had.

    Only that directory is touched. A ``FileNotFoundError`` when there is no such store.
    """
    path = Path(root) / check_key(key)
    aside = Path(root) / scratch_name(key, OLD_MARK)
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        raise FileNotFoundError(f"no feature store {key!r} under {root}") from None
    shutil.rmtree(aside, ignore_errors=True)
    logger.info("removed feature store %s", path)
    return path


def check_stores(root, full: bool = True) -> list[dict]:
    """Every directory under the store ``root``, checked: ``[{"name", "state", "problems", "store"}]`` by name.

    ``state`` is ``"ok"`` (``store`` is the opened :class:`FeatureStore`), ``"damaged"`` (files that
    differ from their checksums, or that cannot be opened; ``problems`` says which and how),
    ``"outdated"`` (another store format: never reused, safe to remove) or ``"unfinished"``
    (a ``.tmp-`` / ``.old-`` directory; ``problems`` says whether its writer is still running).
    ``full`` rehashes every file; otherwise files whose size and mtime match are trusted.
    """
    root = Path(root)
    found = []
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        if not entry.is_dir():
            continue
        name = entry.name
        if TMP_MARK in name or OLD_MARK in name:
            owner = "its writer is still running" if owner_alive(name) else "its writer is gone (stale)"
            found.append({"name": name, "state": "unfinished", "problems": [owner], "store": None})
            continue
        meta = _read_json(entry / "meta.json")
        if isinstance(meta, dict) and meta.get("format") != STORE_FORMAT:
            problem = f"store format {meta.get('format')!r}, this oodviz writes {STORE_FORMAT}; never reused"
            found.append({"name": name, "state": "outdated", "problems": [problem], "store": None})
            continue
        try:
            store = FeatureStore(entry)
            problems = store.verify(full=full)
        except StoreError as err:
            store, problems = None, [str(err)]
        state = "damaged" if problems else "ok"
        found.append({"name": name, "state": state, "problems": problems, "store": store if state == "ok" else None})
    return found


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def run_store_keys(run_dir) -> set[str] | None:
    """The store keys listed in ``<run_dir>/meta.json``, or ``None`` when it has none readable."""
    meta = _read_json(Path(run_dir) / "meta.json")
    splits = meta.get("splits") if isinstance(meta, dict) else None
    if not isinstance(splits, dict):
        return None
    return {s["store"] for s in splits.values() if isinstance(s, dict) and _plain_key(s.get("store"))}


def _plain_key(key) -> bool:
    """A key that names a finished store's directory (never a path out of the store root)."""
    try:
        return isinstance(key, str) and check_key(key) == key
    except ValueError:
        return False


def _run_active(run_dir: Path) -> bool:
    status = _read_json(run_dir / "status.json")
    return isinstance(status, dict) and status.get("state") in ACTIVE_RUN_STATES


def store_users(runs_root) -> dict[str, list[str]]:
    """``{store key: [run ids whose meta.json lists it]}`` over the runs directly under ``runs_root``."""
    users: dict[str, list[str]] = {}
    root = Path(runs_root)
    if not root.is_dir():
        return users
    for run_dir in sorted(root.iterdir()):
        if run_dir.name.startswith(".") or not run_dir.is_dir():
            continue
        for key in run_store_keys(run_dir) or ():
            users.setdefault(key, []).append(run_dir.name)
    return users


def stores_used_only_by(run_dir, runs_root, store_root=None) -> list[Path]:
    """The stores of ``run_dir`` that no other run under ``runs_root`` uses: offer to remove them with it.

    ``store_root`` defaults to ``<runs_root>/.features`` (:data:`STORES_DIRNAME`). Only stores that
    exist are listed. Empty when another run is queued or running without its stores listed yet
    (it may be about to reuse one), and when ``run_dir`` lists none. Damaged files are read as
    "lists no store"; nothing raises.
    """
    run_dir, runs_root = Path(run_dir), Path(runs_root)
    store_root = runs_root / STORES_DIRNAME if store_root is None else Path(store_root)
    mine = run_store_keys(run_dir)
    if not mine:
        return []
    others: set[str] = set()
    if runs_root.is_dir():
        for other in runs_root.iterdir():
            if other.name.startswith(".") or not other.is_dir() or other.resolve() == run_dir.resolve():
                continue
            keys = run_store_keys(other)
            if keys is None and _run_active(other):
                return []
            others |= keys or set()
    return [store_root / key for key in sorted(mine - others) if (store_root / key).is_dir()]
