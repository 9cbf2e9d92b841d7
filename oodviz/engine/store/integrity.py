"""Checksums of a store's array files, computed while the rows are written and checked on reuse.

Each ``.npy`` file of a split is recorded in ``meta.json["files"][<name>]``::

    {"size": bytes, "mtime_ns": int, "data_offset": header bytes,
     "header_blake2b": hex, "data_blake2b": hex}

blake2b (256-bit digests, :mod:`hashlib`, streaming) covers every byte of the file in two parts:
the data bytes ``[data_offset, size)`` are hashed as they are appended, so commit never reads
the arrays back; the header ``[0, data_offset)`` is hashed at commit, after
``_write_header_in_place`` has rewritten its shape to the rows actually written (a few hundred
bytes, the only part read back). ``size`` and ``mtime_ns`` are taken after the file is closed.

Verification (:func:`verify_store`): *cheap* trusts a file whose size and ``mtime_ns`` match the
record without reading it, and rehashes it otherwise; *full* rehashes every file (4 MiB reads).
A store without records (written before checksums existed) is never trusted.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from oodviz.engine.store.keys import ARRAYS

#: How much of a file is read at a time when it is rehashed.
CHUNK_BYTES = 4 << 20
#: ``verify`` levels of :func:`oodviz.engine.extract_or_reuse`.
VERIFY_LEVELS = ("cheap", "full")


def new_digest():
    """The streaming hash used for every store file: blake2b with a 32-byte digest."""
    return hashlib.blake2b(digest_size=32)


def file_record(path: Path, data_offset: int, data_digest) -> dict:
    """The record of a finished, closed file whose data bytes went through ``data_digest``."""
    with open(path, "rb") as f:
        header = f.read(data_offset)
    header_digest = new_digest()
    header_digest.update(header)
    stat = os.stat(path)
    return {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "data_offset": data_offset,
        "header_blake2b": header_digest.hexdigest(),
        "data_blake2b": data_digest.hexdigest(),
    }


def verify_file(path: Path, record: dict, full: bool = False) -> str | None:
    """What is wrong with ``path`` against its ``record``, or ``None`` when it matches.

    Not ``full``: a file whose size and ``mtime_ns`` match the record is trusted unread.
    """
    try:
        stat = os.stat(path)
    except OSError as err:
        return f"{path.name}: cannot be read ({err.strerror or err})"
    if stat.st_size != record["size"]:
        return f"{path.name}: {stat.st_size} bytes, {record['size']} when written"
    if not full and stat.st_mtime_ns == record["mtime_ns"]:
        return None
    header_digest, data_digest = new_digest(), new_digest()
    try:
        with open(path, "rb") as f:
            header_digest.update(f.read(record["data_offset"]))
            while chunk := f.read(CHUNK_BYTES):
                data_digest.update(chunk)
    except OSError as err:
        return f"{path.name}: cannot be read ({err.strerror or err})"
    if header_digest.hexdigest() != record["header_blake2b"]:
        return f"{path.name}: its header differs from the checksum taken when it was written"
    if data_digest.hexdigest() != record["data_blake2b"]:
        return f"{path.name}: its data differ from the checksum taken when it was written"
    return None


def verify_store(path: Path, meta: dict, full: bool = False) -> list[str]:
    """The problems of the store at ``path`` (parsed ``meta.json`` in ``meta``); empty when it is intact.

    Checks every array file (and the head's when ``meta["has_head"]``) against ``meta["files"]``,
    cheaply unless ``full`` (see the module docstring).
    """
    records = meta.get("files")
    if not isinstance(records, dict):
        return ["meta.json has no checksums (written by an older oodviz); it cannot be verified"]
    names = list(ARRAYS) + (["head_weight", "head_bias"] if meta.get("has_head") else [])
    problems = []
    for name in names:
        record = records.get(name)
        if not isinstance(record, dict) or not {"size", "mtime_ns", "data_offset"} <= record.keys():
            problems.append(f"{name}.npy: no checksum in meta.json")
            continue
        problem = verify_file(Path(path) / f"{name}.npy", record, full=full)
        if problem:
            problems.append(problem)
    return problems
