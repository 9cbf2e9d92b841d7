"""What a run config is checked against before any work, besides its own fields (:mod:`oodviz.config.run`).

- :func:`read_config_file`: a ``.json`` or ``.toml`` file -> its table, or a :class:`ConfigError` with one
  message: a missing file, a directory, an unreadable file, bytes that are not UTF-8 (UTF-8, UTF-16 and
  UTF-32 with a byte-order mark are read too), nesting deeper than :data:`MAX_DEPTH`, a top level that
  is not a table, a file larger than :data:`MAX_CONFIG_BYTES`, a key given twice in one table (JSON readers keep
  the last value; TOML refuses it itself) with its line.
- :func:`device_problem_here`: a device that is spelled right but not present on this machine.
- :func:`check_sizes`: the limits that depend on the data (knn's ``k`` <= the fit rows, vim's ``dim`` < D,
  fdbd's two classes), called by the pre-flight (:func:`oodviz.pipeline.preflight.preflight`, before a run is created)
  and again by the run once its model and data are loaded, before extraction.
"""

from __future__ import annotations

import codecs
import json
import os
import tomllib
from pathlib import Path

from oodviz import detectors, models

#: Deepest nesting of tables and lists a config file may have (a run config needs 4).
MAX_DEPTH = 32
#: Largest config file read (a run config is a few kilobytes).
MAX_CONFIG_BYTES = 1 << 20
#: Largest batch_size accepted.
MAX_BATCH_SIZE = 65536

# Longest marks first: the UTF-32 LE mark starts with the UTF-16 LE one.
_BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


#: what a refusal says first: the config is wrong, or it is right but the run cannot start from it
INVALID_CONFIG = "Invalid run config:"
CANNOT_START = "This run cannot start:"


class ConfigError(ValueError):
    """A run that cannot start: ``problems`` lists every one found, under ``heading`` (:data:`INVALID_CONFIG` for a
    config that is wrong in itself, :data:`CANNOT_START` for one the checkpoint file or the data's sizes refuse)."""

    def __init__(self, problems: list[str], heading: str = INVALID_CONFIG):
        self.problems, self.heading = problems, heading
        super().__init__(heading + "\n" + "\n".join(f"- {p}" for p in problems))


def _decode(raw: bytes, path: Path) -> str:
    for mark, encoding in _BYTE_ORDER_MARKS:
        if raw.startswith(mark):
            try:
                return raw.decode(encoding)
            except UnicodeDecodeError as error:
                raise ConfigError(
                    [f"{path} starts with a {encoding} byte-order mark but is not {encoding}: {error}"]
                ) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            [
                f"{path} is not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start}); save it as UTF-8 "
                "(UTF-16 and UTF-32 are read when the file starts with a byte-order mark)"
            ]
        ) from None


def _depth(data) -> int:
    """How deeply tables and lists nest in ``data`` (a scalar: 0), without recursion."""
    deepest, pending = 0, [(data, 1)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:  # deeper is refused anyway; stop walking
            pending.extend((child, level + 1) for child in children)
    return deepest


class _RepeatedKey(Exception):
    """Raised by :func:`_refuse_repeated_keys` while JSON is parsed; :func:`repeated_json_key` then says where."""


def _refuse_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` of the JSON parser: the object, or :class:`_RepeatedKey` when a key repeats in it."""
    table = dict(pairs)
    if len(table) < len(pairs):
        raise _RepeatedKey()
    return table


def repeated_json_key(text: str) -> tuple[str, int, int] | None:
    """``(key, offset, first offset)`` of the first key in ``text`` (valid JSON) that repeats within one object,
    by the offset of its repetition (each offset that of the key's opening quote); None when none does."""
    open_objects: list[dict[str, int] | None] = []  # per open object: its keys' offsets; per open list: None
    key_next = False
    position = 0
    while position < len(text):
        char = text[position]
        if char == '"':
            string, end = json.decoder.scanstring(text, position + 1)
            if key_next:
                seen = open_objects[-1]
                if string in seen:
                    return string, position, seen[string]
                seen[string] = position
                key_next = False
            position = end
            continue
        if char in "{[":
            open_objects.append({} if char == "{" else None)
            key_next = char == "{"
        elif char in "]}":
            open_objects.pop()
        elif char == ",":
            key_next = open_objects[-1] is not None
        position += 1
    return None


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def read_config_file(path: Path) -> dict:
    """The table in config file ``path`` (TOML when it ends in ``.toml``, else JSON); a ConfigError otherwise."""
    path = Path(path)
    kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
    if not path.exists():
        raise ConfigError([f"config file {path} does not exist"])
    if path.is_dir():
        raise ConfigError([f"{path} is a directory; give the path of a .json or .toml config file"])
    if not path.is_file():
        raise ConfigError([f"{path} is not a regular file; give the path of a .json or .toml config file"])
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError([f"cannot read config file {path}: {error.strerror or error}"]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"{path} is larger than {MAX_CONFIG_BYTES // 1024} KiB; a run config is a few kilobytes"])
    text = _decode(raw, path)
    too_deep = f"{path} nests tables or lists more than {MAX_DEPTH} levels deep"
    try:
        data = tomllib.loads(text) if kind == "TOML" else json.loads(text, object_pairs_hook=_refuse_repeated_keys)
    except _RepeatedKey:  # TOML refuses a repeated key itself; JSON readers keep the last value
        key, offset, first = repeated_json_key(text)
        raise ConfigError(
            [
                f"{path}, line {_line(text, offset)}: the key {json.dumps(key)} is given a second time in one table "
                f"(first on line {_line(text, first)}); give each setting once"
            ]
        ) from None
    except ValueError as error:  # the decode errors, and integers of more than 4300 digits
        raise ConfigError([f"{path} is not valid {kind}: {error}"]) from None
    except RecursionError:  # the parsers recurse once per level: far deeper than MAX_DEPTH
        raise ConfigError([too_deep]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path} must hold a table of settings ({{...}} in JSON), got a {type(data).__name__}"])
    if _depth(data) > MAX_DEPTH:
        raise ConfigError([too_deep])
    return data


def device_problem_here(device: str) -> str | None:
    """Why ``device`` (spelled right: :func:`oodviz.models.device_problem`) cannot be used on this machine,
    naming the devices that can; ``None`` when it can. Asks the driver how many GPUs there are, nothing more."""

    # "cuda" means the current GPU, which is 0 in a fresh process: checking cuda:0 keeps CUDA uninitialised here.
    try:
        models.parse_device("cuda:0" if device == "cuda" else device)
    except ValueError as error:
        return str(error).replace("device='cuda:0'", f"device={device!r}")
    return None


def cpu_count() -> int:
    """CPU cores this process may use (the upper bound of num_workers)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_sizes(config, n_fit_rows: int, feature_dim: int, num_classes: int) -> list[str]:
    """The problems of ``config``'s detectors with the data's sizes, known once the model and data are
    loaded: ``n_fit_rows`` (rows of the ID fit split), ``feature_dim`` (D) and ``num_classes`` (C).

    - knn, nnguide: ``k`` <= ``n_fit_rows`` (the k-th neighbour must exist);
    - vim: ``0 < dim < D`` (``dim`` or its default for D);
    - fdbd: C >= 2 (distances to decision boundaries between classes).
    """
    from oodviz.detectors.vim import default_dim

    found = []
    for i, choice in enumerate(config.detectors):
        where = f"detectors[{i}] ({choice.name})"
        if choice.name in ("knn", "nnguide"):
            k = detectors.create(choice.name, **choice.params).k
            if k > n_fit_rows:
                found.append(
                    f"{where}: k={k} is more than the {n_fit_rows} rows of the ID fit set; "
                    f"choose k <= {n_fit_rows} or fit on more data"
                )
        elif choice.name == "vim":
            dim = detectors.create("vim", **choice.params).dim
            dim = default_dim(feature_dim) if dim is None else dim
            if not 0 < dim < feature_dim:
                found.append(
                    f"{where}: dim={dim} must be between 1 and D-1 = {feature_dim - 1} for the D={feature_dim} "
                    "features of this model and layer; choose a dim in that range"
                )
        elif choice.name == "fdbd" and num_classes < 2:
            found.append(f"{where}: needs a model with at least 2 classes, this one has {num_classes}; leave out fdbd")
    return found
