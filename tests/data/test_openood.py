"""OpenOOD v1.5 data roots: a synthetic tree in OpenOOD's layout (``benchmark_imglist/<benchmark>/<list>.txt`` with
lines ``<path> <label>``, images under ``images_classic/`` or ``images_largescale/``) read as oodviz datasets.

The list files sit exactly where OpenOOD's ``DATA_INFO`` puts them; the image paths inside them are shaped like
OpenOOD's (the archive's folder first, e.g. ``tin/test/...``), a few tiny PNGs per set, each with its own colour so
that every test sees which file was read."""

import os
import pickle

import numpy as np
import pytest
from PIL import Image

from oodviz.data import DatasetNotFoundError, available_datasets, dataset_info, dataset_params, load_dataset
from oodviz.data.openood import (
    BENCHMARKS,
    DOWNLOAD_SCRIPT,
    OPENOOD_SETS,
    LayoutProblem,
    benchmark_splits,
    layout_problems,
    openood_set,
)

ITEMS = 3  # images per set


def _colour(position: int, item: int) -> tuple[int, int, int]:
    return (position * 5 % 256, item * 40 + 10, 200)


def _labels(openood_set) -> list[int]:
    if openood_set.labelled:
        return [(7 * i + 1) % openood_set.num_classes for i in range(ITEMS)]
    return list(range(ITEMS))  # OOD lists carry labels too; oodviz ignores them


def _paths(openood_set) -> list[str]:
    subdir = openood_set.list_file.rsplit("/", 1)[1].split("_", 1)[0]  # train / val / test, as OpenOOD's folders
    return [f"{openood_set.archive}/{subdir}/{openood_set.benchmark}_{openood_set.name}_{i}.png" for i in range(ITEMS)]


def write_benchmark(root, benchmark: str) -> dict:
    """Every set of ``benchmark`` under data root ``root``: split -> (paths in the list, labels, colours)."""
    written = {}
    for position, s in enumerate(benchmark_splits(benchmark)):
        paths, labels = _paths(s), _labels(s)
        colours = [_colour(position, i) for i in range(ITEMS)]
        for path, colour in zip(paths, colours):
            target = root / s.image_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (5, 4), colour).save(target)
        list_file = root / s.list_file
        list_file.parent.mkdir(parents=True, exist_ok=True)
        list_file.write_text("".join(f"{p} {label}\n" for p, label in zip(paths, labels)))
        written[s.split] = (paths, labels, colours)
    return written


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("openood")
    return root, {benchmark: write_benchmark(root, benchmark) for benchmark in ("cifar10", "imagenet200")}


# -- the table ---------------------------------------------------------------------------------------------------


def test_the_benchmarks_have_openoods_sets_in_order():
    assert BENCHMARKS == ("cifar10", "cifar100", "imagenet200", "imagenet")
    cifar10 = [(s.split, s.role, s.name, s.group, s.archive) for s in benchmark_splits("cifar10")]
    assert cifar10 == [
        ("id_train", "id_train", "cifar10", None, "cifar10"),
        ("id_val", "id_val", "cifar10", None, "cifar10"),
        ("id_test", "id_test", "cifar10", None, "cifar10"),
        ("csid/cifar10c", "csid", "cifar10c", None, "cifar10c"),
        ("ood_val", "ood_val", "tin", None, "tin"),
        ("near/cifar100", "near", "cifar100", "near", "cifar100"),
        ("near/tin", "near", "tin", "near", "tin"),
        ("far/mnist", "far", "mnist", "far", "mnist"),
        ("far/svhn", "far", "svhn", "far", "svhn"),
        ("far/texture", "far", "texture", "far", "texture"),
        ("far/places365", "far", "places365", "far", "places365"),
    ]
    assert [s.split for s in benchmark_splits("cifar100")] == [
        "id_train", "id_val", "id_test", "ood_val", "near/cifar10", "near/tin",
        "far/mnist", "far/svhn", "far/texture", "far/places365",
    ]  # fmt: skip
    imagenet = [s.split for s in benchmark_splits("imagenet")]
    assert imagenet == [
        "id_train", "id_val", "id_test", "csid/imagenet_v2", "csid/imagenet_c", "csid/imagenet_r", "csid/imagenet_es",
        "ood_val", "near/ssb_hard", "near/ninco", "far/inaturalist", "far/textures", "far/openimage_o",
    ]  # fmt: skip
    assert [s.split for s in benchmark_splits("imagenet200")] == [x for x in imagenet if x != "csid/imagenet_es"]
    assert len(OPENOOD_SETS) == 11 + 10 + 12 + 13
    assert all(s.labelled == (s.role in ("id_train", "id_val", "id_test", "csid")) for s in OPENOOD_SETS)


@pytest.mark.parametrize(
    "benchmark, split, list_file, image_dir, archive",
    [
        ("cifar10", "id_train", "benchmark_imglist/cifar10/train_cifar10.txt", "images_classic", "cifar10"),
        ("cifar10", "ood_val", "benchmark_imglist/cifar10/val_tin.txt", "images_classic", "tin"),
        ("cifar10", "csid/cifar10c", "benchmark_imglist/cifar10/test_cifar10c.txt", "images_classic", "cifar10c"),
        ("cifar100", "near/cifar10", "benchmark_imglist/cifar100/test_cifar10.txt", "images_classic", "cifar10"),
        ("imagenet200", "id_val", "benchmark_imglist/imagenet200/val_imagenet200.txt", "images_largescale", "imagenet_1k"),
        ("imagenet200", "csid/imagenet_v2", "benchmark_imglist/imagenet200/test_imagenet200_v2.txt", "images_largescale", "imagenet_v2"),
        ("imagenet", "csid/imagenet_es", "benchmark_imglist/imagenet/test_imagenet_es.txt", "images_largescale", "imagenet_es"),
        ("imagenet", "ood_val", "benchmark_imglist/imagenet/val_openimage_o.txt", "images_largescale", "openimage_o"),
        ("imagenet", "far/textures", "benchmark_imglist/imagenet/test_textures.txt", "images_classic", "texture"),
    ],
)  # fmt: skip
def test_each_set_reads_the_list_and_folder_openood_names(benchmark, split, list_file, image_dir, archive):
    s = openood_set(benchmark, split)
    assert (s.list_file, s.image_dir, s.archive) == (list_file, image_dir, archive)


# -- reading -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("benchmark", ["cifar10", "imagenet200"])
def test_every_split_loads_with_its_labels_names_and_images(roots, benchmark):
    root, written = roots
    for s in benchmark_splits(benchmark):
        paths, labels, colours = written[benchmark][s.split]
        ds = load_dataset("openood", root=str(root), benchmark=benchmark, split=s.split)
        assert ds.name == f"openood:{benchmark}/{s.split}"
        assert len(ds) == ITEMS
        assert [ds.item_name(i) for i in range(ITEMS)] == [f"{s.image_dir}/{p}" for p in paths]
        if s.labelled:
            assert list(ds.labels) == labels
            assert ds.classes == [str(c) for c in range(s.num_classes)]
        else:
            assert list(ds.labels) == [-1] * ITEMS
            assert ds.classes == []
        for i in range(ITEMS):
            image, label, index = ds[i]
            assert image.mode == "RGB" and image.size == (5, 4)
            assert tuple(np.asarray(image)[0, 0]) == colours[i], (s.split, i)
            assert (label, index) == (int(ds.labels[i]), i)


def test_an_id_split_used_as_ood_loses_its_labels(roots):
    root, _ = roots
    ds = load_dataset("openood", root=str(root), benchmark="cifar10", split="csid/cifar10c", as_ood=True)
    assert list(ds.labels) == [-1] * ITEMS and ds.classes == [] and ds[0][1] == -1


def test_the_dataset_is_registered_once_with_its_parameters():
    assert available_datasets().count("openood") == 1
    info = dataset_info("openood")
    assert (info.kind, info.group, info.source) == ("id", None, "openood")
    assert dataset_params("openood") == {"benchmark": "cifar10", "split": "id_test"}


def test_an_unknown_benchmark_or_split_lists_the_valid_ones(roots):
    root, _ = roots
    with pytest.raises(ValueError, match=r"Unknown OpenOOD benchmark 'cifar-10'\. Did you mean 'cifar10'\?") as error:
        load_dataset("openood", root=str(root), benchmark="cifar-10")
    assert "cifar10, cifar100, imagenet200, imagenet" in str(error.value)
    with pytest.raises(ValueError, match=r"split of OpenOOD benchmark 'cifar10' 'near/tiny'\. Did you mean 'near/tin'"):
        load_dataset("openood", root=str(root), benchmark="cifar10", split="near/tiny")
    with pytest.raises(ValueError, match=r"Choose one of: id_train, id_val, id_test, csid/cifar10c, ood_val, near/"):
        load_dataset("openood", root=str(root), benchmark="cifar10", split="test")
    with pytest.raises(ValueError, match=r"csid/imagenet_v2"):  # imagenet200's csid sets, not cifar10's
        openood_set("imagenet200", "csid/cifar10c")


def _copy_benchmark(tmp_path, benchmark="cifar10"):
    write_benchmark(tmp_path, benchmark)
    return tmp_path


@pytest.mark.parametrize("download", [False, True])
def test_a_missing_list_file_names_the_set_the_file_and_the_archive(tmp_path, download):
    root = _copy_benchmark(tmp_path)
    (root / "benchmark_imglist/cifar10/test_svhn.txt").unlink()
    with pytest.raises(DatasetNotFoundError) as error:
        load_dataset("openood", root=str(root), download=download, benchmark="cifar10", split="far/svhn")
    message = str(error.value)
    assert "cifar10 far/svhn" in message
    assert os.path.join(str(root), "benchmark_imglist", "cifar10", "test_svhn.txt") in message
    assert DOWNLOAD_SCRIPT in message and "'benchmark_imglist'" in message and "--datasets cifar-10" in message
    assert "'svhn'" in message and "--dataset_mode dataset --datasets svhn" in message
    assert ("does not download OpenOOD's data" in message) == download


def test_download_true_reads_files_that_are_there(roots):
    root, written = roots
    ds = load_dataset("openood", root=str(root), download=True, benchmark="cifar10", split="near/tin")
    assert len(ds) == ITEMS and ds.item_name(0) == f"images_classic/{written['cifar10']['near/tin'][0][0]}"


@pytest.mark.parametrize(
    "line, why",
    [
        ("tin/test/a.png 0 extra", r"expected 2 columns \('relative/path label'\), found 3"),
        ("tin/test/a.png", r"expected 2 columns \('relative/path label'\), found 1"),
        ("tin/test/a.png zero", r"the label 'zero' is not an integer"),
        ("/etc/a.png 0", r"the path '/etc/a\.png' must be relative to images_classic/, without '\.\.'"),
        ("tin/../../a.png 0", r"the path 'tin/\.\./\.\./a\.png' must be relative to images_classic/"),
    ],
)
def test_a_malformed_line_names_the_file_and_the_line(tmp_path, line, why):
    root = _copy_benchmark(tmp_path)
    list_file = root / "benchmark_imglist/cifar10/test_tin.txt"
    lines = list_file.read_text().splitlines()
    list_file.write_text("\n".join([lines[0], "", line, lines[1]]) + "\n")  # a blank line 2 is skipped, counted
    with pytest.raises(ValueError, match=rf"test_tin\.txt \(cifar10 near/tin\), line 3: {why}"):
        load_dataset("openood", root=str(root), benchmark="cifar10", split="near/tin")
    [problem] = layout_problems(str(root), "cifar10", ["near/tin"])
    assert (problem.kind, problem.line, problem.count, problem.total) == ("list_malformed", 3, 1, 3)
    assert problem.path == str(list_file) and problem.openood_set.split == "near/tin"


def test_an_id_label_outside_the_classes_is_a_malformed_line(tmp_path):
    root = _copy_benchmark(tmp_path)
    list_file = root / "benchmark_imglist/cifar10/test_cifar10.txt"
    list_file.write_text(list_file.read_text() + "cifar10/test/x.png 10\ncifar10/test/y.png -1\n")
    with pytest.raises(ValueError, match=r"line 4: the label 10 is outside 0\.\.9 .* \(and 1 more bad line"):
        load_dataset("openood", root=str(root), benchmark="cifar10", split="id_test")
    # OOD lists may say anything about labels: -1 or another dataset's classes
    list_file = root / "benchmark_imglist/cifar10/test_cifar100.txt"
    list_file.write_text(list_file.read_text().replace(" 2\n", " 99\n").replace(" 0\n", " -1\n"))
    assert list(load_dataset("openood", root=str(root), benchmark="cifar10", split="near/cifar100").labels) == [-1] * 3


def test_a_missing_or_broken_image_is_skipped_when_read_and_reported_before(tmp_path):
    root = _copy_benchmark(tmp_path)
    paths = _paths(openood_set("cifar10", "far/mnist"))
    (root / "images_classic" / paths[1]).unlink()
    (root / "images_classic" / paths[2]).write_bytes(b"not a png")
    ds = load_dataset("openood", root=str(root), benchmark="cifar10", split="far/mnist")
    assert len(ds) == ITEMS  # images are read lazily: the listing does not look at them
    assert ds[0] is not None and ds[1] is None and ds[2] is None and ds.skipped_indices == [1, 2]
    [problem] = layout_problems(str(root), "cifar10")  # the broken file exists: only decoding would tell
    assert isinstance(problem, LayoutProblem) and problem.field == "data_root"
    assert (problem.kind, problem.openood_set.split, problem.count, problem.total) == (
        "images_missing",
        "far/mnist",
        1,
        3,
    )
    assert problem.examples == (paths[1],)
    assert problem.startswith("cifar10 far/mnist: 1 of the 3 images named by benchmark_imglist/cifar10/test_mnist.txt")
    assert f"images_classic/{paths[1]}" in problem
    assert problem.fix.kind == "advice" and "--datasets mnist" in problem.fix.text and DOWNLOAD_SCRIPT in problem


def test_layout_problems_counts_every_missing_image_of_a_set_and_names_a_few(tmp_path):
    root = _copy_benchmark(tmp_path, "imagenet200")
    textures = openood_set("imagenet200", "far/textures")
    for path in _paths(textures):
        (root / "images_classic" / path).unlink()
    (root / "images_largescale" / "imagenet_1k" / "train").rename(root / "elsewhere")  # a whole folder gone
    problems = layout_problems(str(root), "imagenet200")
    assert [(p.openood_set.split, p.kind, p.count, p.total) for p in problems] == [
        ("id_train", "images_missing", 3, 3),
        ("far/textures", "images_missing", 3, 3),
    ]
    assert problems[0].startswith("imagenet200 id_train: all 3 images") and "image-net.org" in problems[0].fix.text
    assert "'texture'" in problems[1].fix.text and "images_classic/texture/" in problems[1].fix.text
    assert layout_problems(str(root), "imagenet200", ["id_val", "near/ninco"]) == []


def test_layout_problems_of_a_complete_root_an_empty_one_and_a_missing_list(roots, tmp_path):
    root, _ = roots
    assert layout_problems(str(root), "cifar10") == []
    assert layout_problems(str(root), "imagenet200") == []
    [nothing] = layout_problems(str(tmp_path), "cifar100")
    assert (nothing.kind, nothing.openood_set, nothing.path) == (
        "lists_missing",
        None,
        os.path.join(str(tmp_path), "benchmark_imglist", "cifar100"),
    )
    assert "--datasets cifar-100" in nothing.fix.text
    root = _copy_benchmark(tmp_path / "some")
    (root / "benchmark_imglist/cifar10/val_tin.txt").unlink()
    [missing] = layout_problems(str(root), "cifar10")
    assert (missing.kind, missing.openood_set.split) == ("list_missing", "ood_val")
    assert missing.startswith("cifar10 ood_val: list file benchmark_imglist/cifar10/val_tin.txt is missing")
    (root / "benchmark_imglist/cifar10/far_empty.txt").write_text("")  # a file no set reads: ignored
    (root / "benchmark_imglist/cifar10/test_svhn.txt").write_text("\n\n")
    assert [p.kind for p in layout_problems(str(root), "cifar10")] == ["list_missing", "list_empty"]
    with pytest.raises(ValueError, match="names no image"):
        load_dataset("openood", root=str(root), benchmark="cifar10", split="far/svhn")


def test_a_layout_problem_keeps_its_data_through_pickle(tmp_path):
    root = _copy_benchmark(tmp_path)
    (root / "benchmark_imglist/cifar10/test_tin.txt").write_text("tin/test/a.png\n")
    [problem] = layout_problems(str(root), "cifar10", ["near/tin"])
    again = pickle.loads(pickle.dumps(problem))
    assert again == problem and type(again) is LayoutProblem
    assert (again.kind, again.openood_set, again.line, again.field, again.fix) == (
        "list_malformed",
        openood_set("cifar10", "near/tin"),
        1,
        "data_root",
        problem.fix,
    )
