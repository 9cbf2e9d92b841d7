"""Saved detectors: files only, loaded back to the same scores bit for bit; knn references its bank."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rehash_with
from tiny_cnn import TinyCNN, backbone_of, inputs

from oodviz import Batch
from oodviz.detectors import DetectorFileError, available, create, detector_class, load
from oodviz.detectors.persist import MANIFEST, file_sha256, fitted_state

pytestmark = pytest.mark.kernels  # a saved detector reloaded scores the same batches to the bit

FEATURE_BASED = [n for n in available() if not detector_class(n).needs_model]
MODEL_BASED = [n for n in available() if detector_class(n).needs_model]


def shapes_declared(detector) -> bool:
    """Every fitted array of ``detector`` has its axes declared in ``fitted_shapes`` (so a tampered one is caught)."""
    arrays = {k: v.shape for k, v in fitted_state(detector).items() if hasattr(v, "shape")}
    return all(len(shape) == len(detector.fitted_shapes.get(k, "?" * 99)) for k, shape in arrays.items())


def no_pickle_anywhere(directory):
    """Every file is JSON or a plain .npy that numpy reads without pickle."""
    for path in directory.iterdir():
        if path.suffix == ".npy":
            np.load(path, allow_pickle=False)
        else:
            assert path.name == MANIFEST
            json.loads(path.read_text())


@pytest.mark.parametrize("name", FEATURE_BASED)
def test_every_feature_detector_scores_bit_for_bit_after_save_and_load(problem, name, tmp_path):
    detector = create(name).fit(problem.fit_batches(), head=problem.head)
    query = problem.batches(problem.eval_x)
    before = detector.score(query)
    detector.save(tmp_path / name)
    loaded = load(tmp_path / name)
    assert type(loaded) is type(detector) and loaded.get_params() == detector.get_params()
    assert torch.equal(loaded.score(query), before)
    no_pickle_anywhere(tmp_path / name)
    assert shapes_declared(detector)


@pytest.mark.parametrize("name", MODEL_BASED)
def test_every_model_detector_scores_bit_for_bit_with_the_model_given_back(name, tmp_path):
    backbone = backbone_of(TinyCNN(dropout=0.3))
    detector = create(name, model=backbone)
    if detector.needs_fit:  # adascale, gram: statistics of in-distribution inputs (gram per class)
        fit_x = inputs(n=40, seed=2)
        detector.fit(
            [Batch(inputs=x, labels=y) for x, y in zip(fit_x.split(8), torch.arange(40).remainder(5).split(8))]
        )
    else:
        detector.fit(None)
    query = [Batch(inputs=x) for x in inputs(n=24).split(8)]
    before = detector.score(query)
    detector.save(tmp_path / name)
    manifest = json.loads((tmp_path / name / MANIFEST).read_text())
    assert "model" not in manifest["params"]
    loaded = load(tmp_path / name, model=backbone)
    assert torch.equal(loaded.score(query), before)
    assert shapes_declared(detector)
    with pytest.raises(ValueError, match="has no model"):
        load(tmp_path / name).score(query)
    if detector.needs_fit:
        with pytest.raises(ValueError, match=r"learns from in-distribution inputs: call fit\(batches\)"):
            create(name, model=backbone).fit(None)


def test_fitted_arrays_keep_their_dtype_and_values(problem, tmp_path):
    detector = create("mahalanobis").fit(problem.fit_batches())
    detector.save(tmp_path)
    loaded = load(tmp_path)
    for key in ("class_means_", "covariance_", "whitening_", "class_counts_"):
        assert getattr(loaded, key).dtype == getattr(detector, key).dtype
        assert torch.equal(getattr(loaded, key), getattr(detector, key))
        assert getattr(loaded, key).stride() == getattr(detector, key).stride()  # same layout: same matmul bits
    assert loaded.n_features_in_ == problem.fit_x.shape[1] and loaded.n_classes_ is None  # fitted without a head


def test_an_unfitted_detector_loads_unfitted(problem, tmp_path):
    create("knn", k=7).save(tmp_path)
    loaded = load(tmp_path)
    assert loaded.k == 7
    with pytest.raises(ValueError, match=r"call fit\(batches\)"):
        loaded.score(problem.batches(problem.test_x))


def knn_on_a_file_bank(problem, tmp_path):
    """knn fitted from batches that declare their features on disk (as a feature store's do)."""
    bank_file = tmp_path / "features.npy"
    np.save(bank_file, problem.fit_x.numpy())
    on_disk = np.load(bank_file, mmap_mode="r")

    class StoreLike(list):
        features_on_disk = on_disk

    batches = StoreLike(problem.fit_batches())
    return create("knn", k=5).fit(batches), bank_file


def test_a_loaded_knn_references_its_bank_instead_of_copying_it(problem, tmp_path):
    detector, bank_file = knn_on_a_file_bank(problem, tmp_path)
    query = problem.batches(problem.eval_x)
    before = detector.score(query)
    saved = tmp_path / "saved"
    detector.save(saved)
    assert not any(p.suffix == ".npy" for p in saved.iterdir())  # no copy of the bank
    assert sum(p.stat().st_size for p in saved.iterdir()) < bank_file.stat().st_size
    loaded = load(saved)
    assert isinstance(loaded.bank_, np.memmap) and Path(loaded.bank_.filename) == bank_file.resolve()
    assert torch.equal(loaded.score(query), before)


def test_a_knn_bank_that_changed_or_is_gone_is_refused(problem, tmp_path):
    detector, bank_file = knn_on_a_file_bank(problem, tmp_path)
    detector.save(tmp_path / "saved")
    changed = problem.fit_x.numpy().copy()
    changed[3, 1] += 1
    np.save(bank_file, changed)
    with pytest.raises(DetectorFileError, match="changed since the detector was saved"):
        load(tmp_path / "saved")
    bank_file.unlink()
    with pytest.raises(DetectorFileError, match="which is gone"):
        load(tmp_path / "saved")


def test_a_knn_bank_in_a_temporary_directory_is_copied_on_request(problem, tmp_path):
    detector = create("knn", k=5).fit(problem.fit_batches())  # its own bank, removed with the detector
    query = problem.batches(problem.eval_x)
    before = detector.score(query)
    detector.save(tmp_path / "saved", copy_files=True)
    assert (tmp_path / "saved" / "bank_.npy").is_file()
    del detector  # removes its temporary bank
    loaded = load(tmp_path / "saved")
    assert isinstance(loaded.bank_, np.memmap)  # mapped from the copy, not read into memory
    assert Path(loaded.bank_path_) == (tmp_path / "saved" / "bank_.npy").resolve()
    assert torch.equal(loaded.score(query), before)


def test_tampered_and_foreign_files_give_clear_errors(problem, tmp_path):
    with pytest.raises(DetectorFileError, match="not a saved detector directory"):
        load(tmp_path / "nothing")
    create("vim").fit(problem.fit_batches(), head=problem.head).save(tmp_path / "vim")
    # A changed array file
    array = np.load(tmp_path / "vim" / "residual_space_.npy")
    np.save(tmp_path / "vim" / "residual_space_.npy", array * 2)
    with pytest.raises(DetectorFileError, match=r"residual_space_\.npy .*changed since it was saved"):
        load(tmp_path / "vim")
    # A manifest pointing outside its directory
    manifest = json.loads((tmp_path / "vim" / MANIFEST).read_text())
    manifest["state"]["residual_space_"]["file"] = "../elsewhere.npy"
    (tmp_path / "vim" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DetectorFileError, match="names no file of this directory"):
        load(tmp_path / "vim")
    # A pickled .npy whose hash was updated to match is still refused: numpy never unpickles it
    np.save(tmp_path / "vim" / "evil.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    manifest["state"]["residual_space_"].update(file="evil.npy", sha256=file_sha256(tmp_path / "vim" / "evil.npy"))
    (tmp_path / "vim" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DetectorFileError, match="not a plain .npy array"):
        load(tmp_path / "vim")
    # Foreign JSON, another format version, an unknown detector, refused parameters
    for text, message in (
        ("[1, 2]", "not an oodviz detector file"),
        ("{not json", "not valid JSON"),
        (json.dumps({**manifest, "version": 99}), "format version 99"),
        (json.dumps({**manifest, "name": "nonesuch"}), "'nonesuch' detector, which this oodviz does not have"),
        (json.dumps({**manifest, "params": {"dim": -3}}), "its parameters are refused"),
    ):
        (tmp_path / "vim" / MANIFEST).write_text(text)
        with pytest.raises(DetectorFileError, match=message):
            load(tmp_path / "vim")


def test_state_that_cannot_be_saved_is_named(problem, tmp_path):
    detector = create("msp")
    detector.lookup_ = object()
    with pytest.raises(ValueError, match="fitted attribute lookup_ is a object"):
        detector.save(tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"offset": -8},
        {"offset": 1.5},
        {"dtype": "no-such-type"},
        {"dtype": "|O"},
        {"shape": [-1, 12]},
        {"shape": "1200x12"},
        {"shape": [1300, 12]},
        {"offset": 10**6},
    ],
    ids=[
        "negative offset",
        "float offset",
        "unknown dtype",
        "object dtype",
        "negative size",
        "shape not a list",
        "past the end",
        "offset past the end",
    ],
)
def test_a_tampered_knn_bank_entry_is_refused_as_a_detector_file_error(problem, tmp_path, change):
    """The bank's entry in knn's detector.json changed (the bank file itself intact): refused by name, as the other
    tamperings are, never a traceback from numpy (OverflowError for a negative offset, TypeError for a dtype)."""
    detector, _ = knn_on_a_file_bank(problem, tmp_path)
    detector.save(tmp_path / "saved")
    manifest = json.loads((tmp_path / "saved" / MANIFEST).read_text())
    manifest["state"]["bank_"].update(change)
    (tmp_path / "saved" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DetectorFileError, match=r"fitted state bank_ references .*features\.npy .*: run again$"):
        load(tmp_path / "saved")


@pytest.mark.parametrize(
    ("name", "key", "change"),
    [
        ("vim", "residual_space_", lambda a: a[:-1]),  # D = 11 against the head's 12: a matmul error when scored
        ("vim", "origin_", lambda a: a[None]),  # another number of axes
        ("mahalanobis", "whitening_", lambda a: a[:-1]),  # D = 11 against the covariance's 12
        ("mahalanobis", "class_means_", lambda a: a[:-1]),  # C = 5 against the counts' 6
    ],
)
def test_an_array_rehashed_with_another_shape_is_refused_naming_its_file_and_field(
    problem, tmp_path, name, key, change
):
    """The array's SHA-256 and recorded shape both updated to match: the arrays together must still agree on D, C
    (each detector's ``fitted_shapes``), else a DetectorFileError naming the file and the field, not a traceback
    when scored."""
    create(name).fit(problem.fit_batches(), head=problem.head).save(tmp_path / name)
    rehash_with(tmp_path / name, key, change(np.load(tmp_path / name / f"{key}.npy")))
    with pytest.raises(
        DetectorFileError,
        match=rf"{key}\.npy \(fitted state {key}\).*the detector file was changed: save the detector again",
    ):
        load(tmp_path / name)
