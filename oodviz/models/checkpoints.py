"""Weight files: state dicts read safely, checked against an architecture and loaded into it.

Every file is read with ``torch.load(..., weights_only=True)`` (no code from the file runs); a file
that is not what was asked for is a :class:`CheckpointError` (a ``ValueError``) naming the file and saying what was
expected and what was found: a file that cannot be read (a truncated zip, a pickle of other objects than tensors),
a TorchScript file or ``torch.export`` program given as a state dict, missing or unexpected keys,
shape mismatches. ``module.`` prefixes (DataParallel, DDP) and one common prefix are stripped.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from oodviz.models.architectures import USER_MODEL_NAMES, Architecture, build_random, default_weights_dir


class CheckpointError(ValueError):
    """A weights or model file that cannot be used: ``path`` is the file, the message says why and what was
    expected (unreadable, another kind of file, other keys or shapes than the architecture's)."""

    def __init__(self, path: str | os.PathLike, message: str):
        super().__init__(message)
        self.path = Path(path)


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, as hex (a weights file's ``weights_id``), read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def archive_kind(path: Path) -> str | None:
    """``"torchscript"``, ``"export"``, ``"state_dict"`` (a torch.save zip) or ``None`` (not a zip)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return None
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return "torchscript"
    if any(n.endswith("/archive_format") or "/models/" in n for n in names):
        return "export"
    return "state_dict"


def check_file(path) -> Path:
    """``path`` as a Path when it is a file, else a FileNotFoundError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {str(path)!r} does not exist")
    return path


def short_error(error: BaseException, limit: int = 200) -> str:
    """``"<Type>: <message>"`` on one line, cut at ``limit`` characters (to quote inside our own messages)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def unreadable_why(path: Path, error: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` raised ``error``, in a user's words: objects other than
    tensors (refused unread: unpickling them could run code), a zip archive cut short, else ``error`` itself."""
    if isinstance(error, pickle.UnpicklingError):
        return (
            "it pickles objects other than tensors, which are not loaded: unpickling them could run code from the file"
        )
    if archive_kind(path) is None:
        with open(path, "rb") as file:
            if file.read(4) == b"PK\x03\x04":
                return "a damaged zip archive: truncated, or cut short while it was written or copied"
    return short_error(error)


def _examples(keys, n: int = 4) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:n])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def load_state_dict_file(path: Path, expected: str) -> dict[str, Tensor]:
    """``torch.load(weights_only=True)``, unwrapped to a ``{str: Tensor}`` state dict."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        kind = archive_kind(path)
        if kind in USER_MODEL_NAMES:
            what = "a TorchScript file" if kind == "torchscript" else "a torch.export program"
            raise CheckpointError(
                path,
                f"{path} is {what}, not a state dict; load it with load_backbone({kind!r}, checkpoint={str(path)!r})",
            ) from None
        raise CheckpointError(
            path,
            f"{path} could not be read as a state dict ({unreadable_why(path, error)}). Expected {expected}, "
            "saved with torch.save(model.state_dict(), path) (plain tensors only: files are read with "
            "weights_only=True).",
        ) from None
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    is_state_dict = (
        isinstance(obj, Mapping) and obj and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items())
    )
    if not is_state_dict:
        if isinstance(obj, Mapping):
            got = f"a dict with keys {_examples(map(repr, obj))} that are not all str -> tensor"
        else:
            got = f"a {type(obj).__name__}"
        raise CheckpointError(
            path,
            f"{path} holds {got}. Expected {expected}: a mapping of parameter names to tensors, "
            "or {'state_dict': ...} / {'model': ...} around one.",
        )
    return dict(obj)


def _align_keys(state: dict[str, Tensor], expected: set[str]) -> dict[str, Tensor]:
    """Strip ``module.`` (DataParallel/DDP) and, when that makes more keys match, one common prefix."""
    state = {(k[len("module.") :] if k.startswith("module.") else k): v for k, v in state.items()}
    firsts = {k.split(".", 1)[0] for k in state}
    if len(firsts) == 1 and all("." in k for k in state):
        stripped = {k.split(".", 1)[1]: v for k, v in state.items()}
        if len(expected & stripped.keys()) > len(expected & state.keys()):
            return stripped
    return state


def _check_state_dict(
    reference: Mapping[str, Tensor], state: Mapping[str, Tensor], arch: Architecture, path: Path
) -> None:
    missing = [k for k in reference if k not in state]
    unexpected = [k for k in state if k not in reference]
    mismatched = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in reference.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing keys (e.g. {_examples(missing, 3)})")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected keys (e.g. {_examples(unexpected, 3)})")
        if mismatched:
            problems.append(f"{len(mismatched)} shape mismatches, file vs model (e.g. {'; '.join(mismatched[:2])})")
        raise CheckpointError(
            path,
            f"{path} is not a state dict of the {arch.name} architecture: {', '.join(problems)}. Expected the "
            f"state dict of {arch.name} (keys like {_examples(list(reference), 3)}, head {arch.head}.weight); "
            "name the architecture the checkpoint was trained with, or use load_backbone('torchscript', "
            "checkpoint=...) for a TorchScript file.",
        )


def build_from_state_dict(arch: Architecture, state: dict[str, Tensor], path: Path) -> nn.Module:
    """The architecture with the weights of ``state``; the class count comes from the head's shape.

    Built on the meta device (no time spent on a random initialisation that is overwritten),
    then the file's tensors are assigned, as float32.
    """
    with torch.device("meta"):
        skeleton = arch.build(arch.default_classes)
    state = _align_keys(state, set(skeleton.state_dict()))
    head_weight = state.get(f"{arch.head}.weight")
    num_classes = arch.default_classes
    if isinstance(head_weight, Tensor) and head_weight.ndim == 2:
        num_classes = int(head_weight.shape[0])
        if num_classes != arch.default_classes:
            with torch.device("meta"):
                skeleton = arch.build(num_classes)
    _check_state_dict(skeleton.state_dict(), state, arch, path)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    skeleton.load_state_dict(state, strict=True, assign=True)
    leftover = [n for n, t in [*skeleton.named_parameters(), *skeleton.named_buffers()] if t.is_meta]
    if not leftover:
        return skeleton
    model = build_random(arch, num_classes, calibrate=False)  # a buffer outside the state dict: build for real
    model.load_state_dict(state, strict=True)
    return model


def torchvision_state_dict(arch: Architecture, member, weights_dir, allow_download: bool) -> tuple[dict, Path]:
    """The state dict of torchvision weights ``member`` from ``weights_dir`` (default: torchvision's cache)
    and its file; downloaded only with ``allow_download``, else a FileNotFoundError saying where to put it."""
    folder = Path(weights_dir) if weights_dir is not None else default_weights_dir()
    file_name = os.path.basename(urlparse(member.url).path)
    path = folder / file_name
    if not path.is_file():
        if not allow_download:
            raise FileNotFoundError(
                f"{arch.name} weights {type(member).__name__}.{member.name} are not available offline: expected the file "
                f"{file_name!r} in {str(folder)!r}. Download {member.url} on a machine with internet and copy it there "
                f"(or pass weights_dir=<folder holding it>), or pass allow_download=True. "
                "For a dry run without pretrained weights use weights='random'."
            )
        try:
            torch.hub.load_state_dict_from_url(member.url, model_dir=str(folder), progress=False, check_hash=True)
        except Exception as error:
            raise FileNotFoundError(
                f"downloading {member.url} into {str(folder)!r} failed ({short_error(error)}); copy {file_name!r} there by hand, "
                "or use weights='random' for a dry run"
            ) from None
    return load_state_dict_file(path, f"the torchvision {arch.name} weights {member.name}"), path
