"""OpenOOD v1.5's benchmarks read from a data root in OpenOOD's own layout: ``load_dataset("openood", root=...,
benchmark="cifar10", split="near/tin")``.

**The layout.** OpenOOD's download script (``scripts/download/download.py`` in OpenOOD's repository) fills a data
root with one folder of list files and two folders of images::

    <root>/benchmark_imglist/<benchmark>/<list>.txt   one line per image: "<relative/path> <integer label>"
    <root>/images_classic/<archive>/...               32x32 sets: cifar10, cifar100, tin, mnist, svhn, texture, ...
    <root>/images_largescale/<archive>/...            ImageNet-scale sets: imagenet_1k, ssb_hard, ninco, ...

The paths in a list file are relative to the image folder of its set (:attr:`OpenOODSet.image_dir`): for CIFAR-10
``benchmark_imglist/cifar10/test_tin.txt`` names ``tin/test/...`` files under ``images_classic/``. Each archive of
the script unpacks into ``<image folder>/<archive>/``; the list files come in an archive of their own,
``benchmark_imglist``. Which list and which image folder each set reads is OpenOOD's ``DATA_INFO``
(``openood/evaluation_api/datasets.py``), copied into :data:`OPENOOD_SETS`: ImageNet's ``textures`` set reads
``images_classic/`` (the ``texture`` archive that CIFAR uses), every other ImageNet set ``images_largescale/``.

**The benchmarks** (:data:`BENCHMARKS`) and their sets, by role (:data:`ROLES`):

=============  =======  ==============================  ================================================
benchmark      classes  near-OOD / far-OOD              covariate-shifted ID (``csid``)
=============  =======  ==============================  ================================================
cifar10        10       cifar100, tin / mnist, svhn,    cifar10c
                        texture, places365
cifar100       100      cifar10, tin / mnist, svhn,     none
                        texture, places365
imagenet200    200      ssb_hard, ninco / inaturalist,  imagenet_v2, imagenet_c, imagenet_r
                        textures, openimage_o
imagenet       1000     ssb_hard, ninco / inaturalist,  imagenet_v2, imagenet_c, imagenet_r, imagenet_es
                        textures, openimage_o
=============  =======  ==============================  ================================================

Every benchmark also has the ID sets ``id_train``, ``id_val``, ``id_test`` and one OOD validation set ``ood_val``
(``tin`` for CIFAR, ``openimage_o`` for ImageNet). A split is named ``id_train``, ``id_val``, ``id_test``,
``ood_val`` or ``<role>/<set>``: ``near/tin``, ``far/svhn``, ``csid/imagenet_c`` (:attr:`OpenOODSet.split`,
:func:`benchmark_splits`). CIFAR-10's ``cinic10`` list, which ``DATA_INFO`` describes but OpenOOD's evaluator does
not use, is left out.

**Labels and classes.** ID and ``csid`` sets keep their list's labels, which must lie in ``0..C-1``
(:data:`NUM_CLASSES`); OOD sets (``ood_val``, near, far) give every item label ``-1`` and no classes, whatever their
list says (OpenOOD's evaluator ignores those labels too). OpenOOD's list files hold integer labels only, without
class names, so the classes are named ``"0"``..``"C-1"``; a model that names its classes (torchvision's ImageNet
weights) does not match these names, and the pre-flight's class check says so.

**Downloads.** OpenOOD's data lives on Google Drive and is fetched by OpenOOD's own script; oodviz does not download
it. A missing list file is a :class:`~oodviz.data.DatasetNotFoundError` that names the set, the file, the archive
to fetch and the script's command (:meth:`OpenOODSet.advice`); with ``download=True`` the error also says that
oodviz cannot fetch it. ``download=True`` with the files present just reads them. Three sets need more than the
script's per-archive command: ImageNet's training images are not in OpenOOD's archives (ImageNet-1K's own
download), the script does not know ``imagenet_es`` (OpenOOD's evaluator fetches it), and the script's
``cifar-10`` / ``cifar-100`` groups lack ``cifar10c`` (its ``misc`` group) and, for CIFAR-100, ``mnist``: fetch
those by archive name.

**Reading.** A list line is ``<path> <label>``: two columns split on white space, an integer label, a relative
path without ``..``; blank lines are skipped. A line that is not one of those is a ValueError naming the file and
the line number. Images are read lazily, decoded as RGB by :func:`~oodviz.data.folders.read_image`; a missing or
undecodable image is skipped and counted like an image folder's (``None`` items). :func:`layout_problems` checks
a benchmark before any work: every list file there and well-formed, every image it names present (by directory
listing, nothing decoded); the pre-flight does not call it (its datasets are checked by loading, which reads the
lists but not the images), so a caller that wants the image check calls it itself.
"""

from __future__ import annotations

import difflib
import os
import posixpath
from dataclasses import dataclass

import numpy as np
from PIL import Image

from oodviz.data.base import Source
from oodviz.data.folders import read_image
from oodviz.data.registry import DatasetInfo, register_dataset
from oodviz.data.torchvision_sets import DatasetNotFoundError
from oodviz.problems import Fix, Problem

#: The four benchmarks of OpenOOD v1.5, as its ``DATA_INFO`` names them.
BENCHMARKS = ("cifar10", "cifar100", "imagenet200", "imagenet")
#: Number of ID classes of each benchmark; ID labels lie in ``0..NUM_CLASSES[benchmark]-1``.
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "imagenet200": 200, "imagenet": 1000}
#: A set's role: ID training / validation / test, OOD validation, near- or far-OOD test, covariate-shifted ID.
ROLES = ("id_train", "id_val", "id_test", "ood_val", "near", "far", "csid")
#: Roles whose items keep their labels (the others are OOD: label ``-1``).
LABELLED_ROLES = ("id_train", "id_val", "id_test", "csid")
#: The folder of list files under the data root; also the name of the download script's archive of them.
LIST_DIR = "benchmark_imglist"
#: The image folders under the data root: 32x32 sets, ImageNet-scale sets.
CLASSIC = "images_classic"
LARGESCALE = "images_largescale"
#: OpenOOD's download script, in OpenOOD's repository (github.com/Jingkang50/OpenOOD).
DOWNLOAD_SCRIPT = "scripts/download/download.py"
#: The download script's name (``--datasets``) for the archives of a whole benchmark.
DOWNLOAD_GROUPS = {
    "cifar10": "cifar-10",
    "cifar100": "cifar-100",
    "imagenet200": "imagenet-200",
    "imagenet": "imagenet-1k",
}
#: At most this many missing image paths in a :class:`LayoutProblem`.
EXAMPLES = 5


@dataclass(frozen=True)
class OpenOODSet:
    """One list file of OpenOOD v1.5: a set of images with one role in one benchmark.

    - ``benchmark``: one of :data:`BENCHMARKS`; ``role``: one of :data:`ROLES`;
    - ``name``: the set as OpenOOD names it (``"tin"``, ``"ssb_hard"``; the ID sets: the benchmark's name);
    - ``list_file``: the list file, relative to the data root (``"benchmark_imglist/cifar10/test_tin.txt"``);
    - ``image_dir``: the folder its list's paths are relative to, under the data root (``"images_classic"``);
    - ``archive``: the download script's name of the archive holding its images (``"tin"``), unpacked into
      ``<image_dir>/<archive>/``;
    - ``fetch``: how to get the images when the script's per-archive command does not (empty when it does).
    """

    benchmark: str
    role: str
    name: str
    list_file: str
    image_dir: str
    archive: str
    fetch: str = ""

    @property
    def split(self) -> str:
        """The split that names this set: its role for ID and OOD validation sets, ``<role>/<name>`` otherwise."""
        return f"{self.role}/{self.name}" if self.role in ("near", "far", "csid") else self.role

    @property
    def group(self) -> str | None:
        """``"near"`` or ``"far"`` for a near- or far-OOD test set, else ``None``."""
        return self.role if self.role in ("near", "far") else None

    @property
    def labelled(self) -> bool:
        """Whether its items keep their labels (ID and covariate-shifted ID sets)."""
        return self.role in LABELLED_ROLES

    @property
    def num_classes(self) -> int:
        """The number of ID classes of its benchmark."""
        return NUM_CLASSES[self.benchmark]

    def list_path(self, root: str) -> str:
        """The list file under data root ``root``."""
        return os.path.join(root, *self.list_file.split("/"))

    def image_root(self, root: str) -> str:
        """The folder under data root ``root`` that the list's paths are relative to."""
        return os.path.join(root, self.image_dir)

    def describe(self) -> str:
        """``"cifar10 near/tin"``: how messages name it."""
        return f"{self.benchmark} {self.split}"

    def advice(self, root: str) -> str:
        """How to get this set's images into data root ``root`` (a sentence)."""
        if self.fetch:
            return self.fetch
        command = (
            f"python {DOWNLOAD_SCRIPT} --contents datasets --dataset_mode dataset --datasets {self.archive} "
            f"--save_dir {root}"
        )
        return (
            f"fetch archive {self.archive!r} into {self.image_dir}/{self.archive}/ with OpenOOD's download script, "
            f"in a checkout of OpenOOD: {command}"
        )


def list_advice(benchmark: str, root: str) -> str:
    """How to get the list files into data root ``root`` (a sentence)."""
    return (
        f"the list files come in OpenOOD's {LIST_DIR!r} archive; OpenOOD's download script fetches it, with the "
        f"benchmark's images, when the data root has no {LIST_DIR}/ folder (move an incomplete one away first): "
        f"python {DOWNLOAD_SCRIPT} --contents datasets --datasets {DOWNLOAD_GROUPS[benchmark]} --save_dir {root}, "
        "in a checkout of OpenOOD"
    )


_IMAGENET_TRAIN = (
    "OpenOOD's archives hold no ImageNet-1K training images: download them from image-net.org and put them where "
    "the list's paths point, under images_largescale/"
)
_IMAGENET_ES = (
    f"the download script does not list 'imagenet_es'; OpenOOD's evaluator (openood/evaluation_api/datasets.py) "
    f"fetches it into {LARGESCALE}/imagenet_es/"
)


def _cifar(benchmark: str, other: str, csid: tuple[str, ...]) -> list[OpenOODSet]:
    def entry(role, name, file, archive):
        return OpenOODSet(benchmark, role, name, f"{LIST_DIR}/{benchmark}/{file}.txt", CLASSIC, archive)

    sets = [entry(role, benchmark, f"{role[3:]}_{benchmark}", benchmark) for role in ("id_train", "id_val", "id_test")]
    sets += [entry("csid", name, f"test_{name}", name) for name in csid]
    sets.append(entry("ood_val", "tin", "val_tin", "tin"))
    sets += [entry("near", name, f"test_{name}", name) for name in (other, "tin")]
    sets += [entry("far", name, f"test_{name}", name) for name in ("mnist", "svhn", "texture", "places365")]
    return sets


def _imagenet(benchmark: str, csid: tuple[str, ...]) -> list[OpenOODSet]:
    def entry(role, name, file, archive, image_dir=LARGESCALE, fetch=""):
        return OpenOODSet(benchmark, role, name, f"{LIST_DIR}/{benchmark}/{file}.txt", image_dir, archive, fetch)

    sets = [entry("id_train", benchmark, f"train_{benchmark}", "imagenet_1k", fetch=_IMAGENET_TRAIN)]
    sets += [entry(role, benchmark, f"{role[3:]}_{benchmark}", "imagenet_1k") for role in ("id_val", "id_test")]
    # the list of imagenet_v2 is test_<benchmark>_v2.txt, of imagenet_c test_<benchmark>_c.txt, ...
    for name in csid:
        fetch = _IMAGENET_ES if name == "imagenet_es" else ""
        sets.append(entry("csid", name, f"test_{benchmark}_{name.removeprefix('imagenet_')}", name, fetch=fetch))
    sets.append(entry("ood_val", "openimage_o", "val_openimage_o", "openimage_o"))
    sets += [entry("near", name, f"test_{name}", name) for name in ("ssb_hard", "ninco")]
    sets.append(entry("far", "inaturalist", "test_inaturalist", "inaturalist"))
    sets.append(entry("far", "textures", "test_textures", "texture", image_dir=CLASSIC))
    sets.append(entry("far", "openimage_o", "test_openimage_o", "openimage_o"))
    return sets


#: Every set of the four benchmarks, benchmark by benchmark, each in :func:`benchmark_splits`'s order.
OPENOOD_SETS: tuple[OpenOODSet, ...] = (
    *_cifar("cifar10", "cifar100", ("cifar10c",)),
    *_cifar("cifar100", "cifar10", ()),
    *_imagenet("imagenet200", ("imagenet_v2", "imagenet_c", "imagenet_r")),
    *_imagenet("imagenet", ("imagenet_v2", "imagenet_c", "imagenet_r", "imagenet_es")),
)


def _choose(what: str, value, valid: list[str]) -> str:
    value = str(value)
    if value in valid:
        return value
    close = difflib.get_close_matches(value, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown {what} {value!r}.{hint} Choose one of: {', '.join(valid)}")


def benchmark_splits(benchmark: str) -> list[OpenOODSet]:
    """The sets of ``benchmark`` (one of :data:`BENCHMARKS`; a ValueError lists them), in the order ID train, val,
    test, covariate-shifted ID, OOD validation, near-OOD, far-OOD; each says its ``split``, ``role``, ``name`` and
    ``group``."""
    benchmark = _choose("OpenOOD benchmark", benchmark, list(BENCHMARKS))
    return [s for s in OPENOOD_SETS if s.benchmark == benchmark]


def openood_set(benchmark: str, split: str) -> OpenOODSet:
    """The set of ``benchmark`` named by ``split`` (``"id_test"``, ``"near/tin"``, ...); a ValueError that lists the
    valid benchmarks or splits (with the closest match) for an unknown one."""
    sets = benchmark_splits(benchmark)
    split = _choose(f"split of OpenOOD benchmark {sets[0].benchmark!r}", split, [s.split for s in sets])
    return next(s for s in sets if s.split == split)


@dataclass(frozen=True)
class _Listing:
    """A list file read: the image paths (relative to the set's image folder) and labels, in file order, and its
    bad lines: how many, the first one's number and what is wrong with it."""

    paths: list[str]
    labels: np.ndarray
    bad: int = 0
    first_bad: int = 0
    why: str = ""


def _line_problem(parts: list[str], image_dir: str, num_classes: int | None) -> str | None:
    if len(parts) != 2:
        return f"expected 2 columns ('relative/path label'), found {len(parts)}"
    path, label = parts
    try:
        value = int(label)
    except ValueError:
        return f"the label {label!r} is not an integer"
    if path.startswith(("/", "\\")) or ".." in path.replace("\\", "/").split("/"):
        return f"the path {path!r} must be relative to {image_dir}/, without '..'"
    if num_classes is not None and not 0 <= value < num_classes:
        return f"the label {value} is outside 0..{num_classes - 1} (the benchmark's {num_classes} classes)"
    return None


def _read_listing(path: str, openood_set: OpenOODSet) -> _Listing:
    """The lines of list file ``path``; OSError when it cannot be opened, UnicodeDecodeError when it is not text."""
    num_classes = openood_set.num_classes if openood_set.labelled else None
    paths, labels, bad, first_bad, why = [], [], 0, 0, ""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            parts = line.split()
            if not parts:
                continue
            problem = _line_problem(parts, openood_set.image_dir, num_classes)
            if problem is not None:
                bad += 1
                if bad == 1:
                    first_bad, why = number, problem
                continue
            paths.append(parts[0])
            labels.append(int(parts[1]))
    return _Listing(paths, np.asarray(labels, dtype=np.int64), bad, first_bad, why)


def _bad_lines_message(openood_set: OpenOODSet, path: str, listing: _Listing) -> str:
    more = f" (and {listing.bad - 1:,} more bad line(s))" if listing.bad > 1 else ""
    return (
        f"OpenOOD list file {path} ({openood_set.describe()}), line {listing.first_bad}: {listing.why}{more}. Each "
        f"line must be an image path relative to {openood_set.image_dir}/ and an integer label, as in OpenOOD's "
        f"own list files: fetch a fresh {LIST_DIR} archive if this one was edited or cut short"
    )


class OpenOODSource(Source):
    """The images of one OpenOOD list file (:class:`OpenOODSet`) under data root ``root``; see the module docstring.

    ``files``: the list's paths, relative to ``<root>/<image_dir>``; ``item_name(i)``: the path of item ``i``
    relative to the data root (``"images_classic/tin/test/..."``)."""

    def __init__(self, root: str, openood_set: OpenOODSet, download: bool = False):
        self.root = os.path.abspath(os.path.expanduser(str(root)))
        self.set = openood_set
        path = openood_set.list_path(self.root)
        if not os.path.isfile(path):
            advice = list_advice(openood_set.benchmark, self.root)
            advice = (
                f"oodviz does not download OpenOOD's data (it is on Google Drive): {advice}" if download else advice
            )
            raise DatasetNotFoundError(
                f"OpenOOD list file {path} of {openood_set.describe()} does not exist under data root {self.root}; "
                f"{advice}; for the images, {openood_set.advice(self.root)}"
            )
        try:
            listing = _read_listing(path, openood_set)
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(
                f"OpenOOD list file {path} ({openood_set.describe()}) cannot be read ({error}); fetch a fresh "
                f"{LIST_DIR} archive"
            ) from error
        if listing.bad:
            raise ValueError(_bad_lines_message(openood_set, path, listing))
        if not listing.paths:
            raise ValueError(
                f"OpenOOD list file {path} ({openood_set.describe()}) names no image; fetch a fresh {LIST_DIR} archive"
            )
        self.files = listing.paths
        self.image_dir = openood_set.image_root(self.root)
        if openood_set.labelled:
            self._labels = listing.labels
            self.classes = [str(c) for c in range(openood_set.num_classes)]
        else:
            self._labels = np.full(len(listing.paths), -1, dtype=np.int64)
            self.classes = []

    def __len__(self) -> int:
        return len(self.files)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def load(self, index: int) -> tuple[Image.Image, int]:
        return read_image(os.path.join(self.image_dir, self.files[index]), "RGB"), int(self._labels[index])

    def item_name(self, index: int) -> str:
        return f"{self.set.image_dir}/{self.files[index]}"

    @property
    def display_name(self) -> str:
        return f"openood:{self.set.benchmark}/{self.set.split}"


def load_openood(root: str, download: bool, benchmark: str = "cifar10", split: str = "id_test") -> OpenOODSource:
    """The set ``split`` of OpenOOD benchmark ``benchmark`` under data root ``root`` (:func:`openood_set`)."""
    return OpenOODSource(root, openood_set(benchmark, split), download=download)


# -- checking a data root before any work ------------------------------------------------------------------------

#: What a :class:`LayoutProblem` is about: the benchmark's folder of lists missing, a list file missing, unreadable,
#: malformed or empty, images its list names missing.
LAYOUT_PROBLEM_KINDS = (
    "lists_missing",
    "list_missing",
    "list_unreadable",
    "list_malformed",
    "list_empty",
    "images_missing",
)


class LayoutProblem(Problem):
    """A problem of an OpenOOD data root (:func:`layout_problems`), about the config's ``data_root``; as data:

    - ``kind``: one of :data:`LAYOUT_PROBLEM_KINDS`;
    - ``openood_set``: the :class:`OpenOODSet` it is about (``None`` for ``"lists_missing"``: the whole benchmark);
    - ``path``: the file or folder concerned (the list file; the benchmark's list folder for ``"lists_missing"``);
    - ``line``: the first bad line (``"list_malformed"``), else ``None``;
    - ``count``: how many bad lines or missing images; ``total``: of how many lines or images;
    - ``examples``: the first few missing images, relative to the data root;
    - ``fix``: a :class:`~oodviz.problems.Fix` of kind ``"advice"`` saying what to fetch (its ``text``)."""

    kind: str
    openood_set: OpenOODSet | None
    path: str
    line: int | None
    count: int
    total: int
    examples: tuple[str, ...]
    fix: Fix | None

    def __new__(
        cls,
        message: str,
        kind: str = "",
        openood_set: OpenOODSet | None = None,
        path: str = "",
        line: int | None = None,
        count: int = 0,
        total: int = 0,
        examples: tuple[str, ...] = (),
        fix: Fix | None = None,
    ):
        problem = super().__new__(cls, message, "data_root")
        problem.kind, problem.openood_set, problem.path, problem.line = kind, openood_set, path, line
        problem.count, problem.total, problem.examples, problem.fix = count, total, tuple(examples), fix
        return problem


def _missing_images(image_root: str, paths: list[str]) -> tuple[int, list[str]]:
    """How many of ``paths`` (relative to ``image_root``) are not files, and the first :data:`EXAMPLES` of them: each
    folder is listed once (links followed), nothing is opened."""
    listed: dict[str, set[str]] = {}
    missing, examples = 0, []
    for relative in paths:
        folder, name = posixpath.split(posixpath.normpath(relative))
        if folder not in listed:
            try:
                with os.scandir(os.path.join(image_root, folder)) as entries:
                    listed[folder] = {entry.name for entry in entries if entry.is_file()}
            except OSError:  # no such folder (or not readable): none of its images can be read
                listed[folder] = set()
        if name not in listed[folder]:
            missing += 1
            if len(examples) < EXAMPLES:
                examples.append(relative)
    return missing, examples


def _set_problems(root: str, openood_set: OpenOODSet) -> list[LayoutProblem]:
    path = openood_set.list_path(root)
    where = f"{openood_set.describe()}: list file {openood_set.list_file}"
    list_fix = Fix("advice", list_advice(openood_set.benchmark, root))
    if not os.path.isfile(path):
        message = f"{where} is missing under {root}; {list_fix.text}"
        return [LayoutProblem(message, "list_missing", openood_set, path, fix=list_fix)]
    try:
        listing = _read_listing(path, openood_set)
    except (OSError, UnicodeDecodeError) as error:
        message = f"{where} cannot be read ({error}); {list_fix.text}"
        return [LayoutProblem(message, "list_unreadable", openood_set, path, fix=list_fix)]
    if listing.bad:
        message = f"{openood_set.describe()}: " + _bad_lines_message(openood_set, path, listing)
        total = listing.bad + len(listing.paths)
        return [
            LayoutProblem(
                message, "list_malformed", openood_set, path, listing.first_bad, listing.bad, total, fix=list_fix
            )
        ]
    if not listing.paths:
        message = f"{where} names no image; {list_fix.text}"
        return [LayoutProblem(message, "list_empty", openood_set, path, fix=list_fix)]
    image_root = openood_set.image_root(root)
    missing, examples = _missing_images(image_root, listing.paths)
    if not missing:
        return []
    fix = Fix("advice", openood_set.advice(root))
    total = len(listing.paths)
    shown = ", ".join(f"{openood_set.image_dir}/{e}" for e in examples) + (", ..." if missing > len(examples) else "")
    how_many = f"all {total:,}" if missing == total else f"{missing:,} of the {total:,}"
    message = (
        f"{openood_set.describe()}: {how_many} images named by {openood_set.list_file} are missing under {root} "
        f"(e.g. {shown}); {fix.text}"
    )
    return [
        LayoutProblem(
            message, "images_missing", openood_set, path, count=missing, total=total, examples=tuple(examples), fix=fix
        )
    ]


def layout_problems(root: str, benchmark: str, splits: list[str] | None = None) -> list[LayoutProblem]:
    """Every problem of data root ``root`` for the sets ``splits`` of OpenOOD benchmark ``benchmark`` (``None``: all of
    :func:`benchmark_splits`), found without decoding an image: each list file there, readable, well-formed and not
    empty, and every image it names present (one :class:`LayoutProblem` per set, counting its missing images and
    naming the first few). ``[]``: the sets can be read. A ValueError for an unknown benchmark or split.

    One ``"lists_missing"`` problem stands for all when the benchmark's list folder is not there. Checking a set
    lists each folder its images are in once: ImageNet's training list (1.28 million images in 1,000 folders) takes
    seconds on a local disk, longer on a network file system."""
    sets = benchmark_splits(benchmark) if splits is None else [openood_set(benchmark, split) for split in splits]
    if not sets:
        return []
    root = os.path.abspath(os.path.expanduser(str(root)))
    folder = os.path.join(root, LIST_DIR, sets[0].benchmark)
    if not os.path.isdir(folder):
        fix = Fix("advice", list_advice(sets[0].benchmark, root))
        message = (
            f"OpenOOD benchmark {sets[0].benchmark}: no list folder {LIST_DIR}/{sets[0].benchmark}/ under data root "
            f"{root}; {fix.text}"
        )
        return [LayoutProblem(message, "lists_missing", None, folder, fix=fix)]
    return [problem for s in sets for problem in _set_problems(root, s)]


register_dataset(
    DatasetInfo(
        "openood",
        "OpenOOD v1.5's benchmarks (cifar10, cifar100, imagenet200, imagenet) from a data root in OpenOOD's layout: "
        "benchmark=..., split=id_train|id_val|id_test|ood_val|near/<set>|far/<set>|csid/<set>",
        "id",
        None,
        "openood",
        "varies RGB",
    ),
    load_openood,
)
