"""The user's own images: ``load_dataset("folder", path=...)``.

Two layouts (``layout="auto"`` tells them apart):

- ``"classes"``, ImageFolder-style: ``path/<class>/**/<image>``. Classes are the subfolder
  names sorted (as ``torchvision.datasets.ImageFolder`` does), labels their positions.
- ``"flat"``: images anywhere under ``path`` (subfolders included), labels ``-1``, no classes:
  the usual shape of an OOD folder.

``"auto"`` picks ``"classes"`` when ``path`` has (non-hidden) subfolders and ``"flat"``
otherwise. Images are files with an extension in :data:`IMAGE_EXTENSIONS` (any case);
hidden files and folders (name starting with ``.``) are ignored. A file that cannot be
decoded is not an error: the dataset returns ``None`` for it and counts it in ``skipped``.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
from PIL import Image

from oodviz.data.base import Source, UnreadableImageError
from oodviz.data.class_map import CLASS_MAPS, ModelClassSource
from oodviz.data.registry import DatasetInfo, register_dataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
LAYOUTS = ("auto", "classes", "flat")
MODES = ("RGB", "L", None)


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _directory_key(path: str) -> tuple[int, int]:
    status = os.stat(path)  # follows links: the directory a link leads to
    return status.st_dev, status.st_ino


def _images_under(directory: str, visited: set[tuple[int, int]]) -> list[str]:
    """Image files under ``directory`` (recursively, following links), sorted, hidden ones skipped.

    A directory already in ``visited`` (by device and inode, links resolved) is not walked again, so a
    link loop ends and a linked folder is read once; ``visited`` gains every directory walked. A
    subfolder that cannot be read is an error (its images would be missing silently otherwise)."""
    unreadable = []
    found = []
    visited.add(_directory_key(directory))
    for parent, dirs, files in os.walk(directory, followlinks=True, onerror=unreadable.append):
        kept = []
        for name in sorted(d for d in dirs if not d.startswith(".")):
            try:
                key = _directory_key(os.path.join(parent, name))
            except OSError as error:  # a dangling link, or one we may not follow
                unreadable.append(error)
                continue
            if key not in visited:
                visited.add(key)
                kept.append(name)
        dirs[:] = kept
        found.extend(os.path.join(parent, f) for f in sorted(files) if _is_image(f))
    if unreadable:
        raise ValueError(
            f"{len(unreadable)} folder(s) under {directory} cannot be read ({unreadable[0].strerror}); "
            "give the app read access to them or remove them"
        )
    return found


def read_image(path: str, mode: str | None = "RGB") -> Image.Image:
    """Decode ``path`` fully (so truncation shows here) and convert to ``mode`` (``None`` = keep).

    Raises :class:`UnreadableImageError` for anything that cannot be read or decoded.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.load()
                return image.convert(mode) if mode is not None and image.mode != mode else image.copy()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise UnreadableImageError(f"cannot read image {path}: {error}") from error


class FolderSource(Source):
    """Image files under a folder, in the ``classes`` or ``flat`` layout (see the module docstring)."""

    def __init__(self, path: str, layout: str = "auto", mode: str | None = "RGB"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be 'RGB', 'L' or None (keep each file's mode), got {mode!r}")
        if path is None or str(path) == "":
            raise ValueError('The "folder" dataset needs path=<a directory of images>')
        path = os.path.abspath(os.path.expanduser(str(path)))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"Image folder {path} is a file, not a directory; give the folder that holds the images")
        if not os.path.isdir(path):
            raise ValueError(f"Image folder {path} does not exist")
        self.path = path
        self.mode = mode
        extensions = ", ".join(IMAGE_EXTENSIONS)
        try:
            with os.scandir(path) as entries:
                entries = sorted(entries, key=lambda e: e.name)
                subdirs = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
                loose = [e.name for e in entries if e.is_file() and _is_image(e.name)]
        except OSError as error:
            raise ValueError(f"Image folder {path} cannot be read ({error.strerror})") from error
        visited = {_directory_key(path)}  # directories walked, shared by all classes: none is read twice
        if layout == "auto":
            layout = "classes" if subdirs else "flat"
        self.layout = layout
        if layout == "flat":
            self.files = _images_under(path, visited)
            self._labels = np.full(len(self.files), -1, dtype=np.int64)
            self.classes = []
            if not self.files:
                raise ValueError(f"No images found under {path}; expected files with extensions {extensions}")
            return
        if not subdirs:
            raise ValueError(
                f"layout='classes' needs one subfolder per class in {path} (path/<class>/<image>), found none; "
                "use layout='flat' for a folder of unlabelled images"
            )
        # The errors below give counts, never the folder's contents: the path may be any directory of the server.
        if loose:
            raise ValueError(
                f"{path} has {len(subdirs)} class subfolder(s) and also {len(loose)} image(s) directly in it; "
                "move them into a class folder, or pass layout='flat' to use every image unlabelled"
            )
        files, labels, empty = [], [], 0
        for label, name in enumerate(subdirs):
            found = _images_under(os.path.join(path, name), visited)
            empty += not found
            files.extend(found)
            labels.extend([label] * len(found))
        if empty:
            raise ValueError(
                f"{empty} of the {len(subdirs)} subfolder(s) of {path} hold no images (extensions {extensions}), or "
                "only links to folders already read; expected one subfolder of images per class "
                "(path/<class>/<image>): add images, remove the empty folders, or pass layout='flat'"
            )
        self.files = files
        self._labels = np.asarray(labels, dtype=np.int64)
        self.classes = subdirs

    def __len__(self) -> int:
        return len(self.files)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def load(self, index: int) -> tuple[Image.Image, int]:
        return read_image(self.files[index], self.mode), int(self._labels[index])

    def item_name(self, index: int) -> str:
        return self.files[index]

    @property
    def display_name(self) -> str:
        return f"folder:{os.path.basename(self.path)}"


def load_folder(
    root: str,
    download: bool,
    path: str | None = None,
    layout: str = "auto",
    mode: str | None = "RGB",
    class_map: str | None = None,
    model_classes: list[str] | None = None,
):
    """``class_map="model"``: label each image with its folder's index among ``model_classes`` (see
    :mod:`oodviz.data.class_map`) instead of the folder's position in sorted order."""
    if class_map not in CLASS_MAPS:
        raise ValueError(f'class_map must be "model" or unset, got {class_map!r}')
    source = FolderSource(path, layout=layout, mode=mode)
    if class_map is None:
        return source
    if source.layout != "classes":
        raise ValueError(f'class_map="model" needs class subfolders (path/<class>/<image>); {source.path} has none')
    return ModelClassSource(source, model_classes)


register_dataset(
    DatasetInfo(
        "folder",
        "Your own images: class subfolders (path/<class>/<image>, labelled) or a flat folder (unlabelled, OOD)",
        "id",
        None,
        "folder",
        "varies",
    ),
    load_folder,
)
