"""A run saves its detectors; ``oodviz score`` scores new image files with them (on the bundled default run)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import oodviz_in_process, rehash_with
from PIL import Image

from oodviz.cli import main as cli_main
from oodviz.data import load_dataset
from oodviz.detectors import detector_class, load
from oodviz.engine import STORES_DIRNAME, open_store
from oodviz.pipeline.scoring import BACKBONE_FILE, SCORED_COLUMNS, detectors_dir
from oodviz.results.tables import ID_SPLIT, OOD_SPLIT

pytestmark = pytest.mark.kernels  # saved detectors scoring the run's stores to the bit: the same batches as the run's

SHOWN = (0, 5, 17)  # digits-test images written as files


def oodviz_score(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "oodviz.cli", "score", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(cwd),
    )


def test_every_saved_detector_reproduces_the_runs_scores_bit_for_bit(default_run, default_results):
    """Loaded from the run directory, each feature detector scores the run's ID test store to the very bits
    of ``scores.parquet``."""
    path = default_run.path
    store = open_store(path.parent / STORES_DIRNAME, default_results.meta["splits"]["id_test"]["store"])
    stored = default_results.scores[default_results.scores.split == ID_SPLIT]
    assert np.array_equal(stored["index"].to_numpy(), np.asarray(store.indices))
    names = [n for n in default_results.detectors if not detector_class(n).needs_model]
    assert len(names) >= 15
    for name in names:
        scores = load(detectors_dir(path) / name).score(store.batches(4096)).numpy()
        assert np.array_equal(scores, stored[name].to_numpy()), name


def test_the_runs_knn_references_the_id_fit_store_as_its_bank(default_run, default_results):
    knn_dir = detectors_dir(default_run.path) / "knn"
    knn = load(knn_dir)
    store = default_results.meta["splits"]["id_fit"]["store"]
    assert Path(knn.bank_.filename) == (default_run.path.parent / STORES_DIRNAME / store / "features.npy").resolve()
    assert not any(p.suffix == ".npy" for p in knn_dir.iterdir())  # no copy of the bank


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    """Three digits-test images as PNG files, a noise image, and a file that is not an image."""
    root = tmp_path_factory.mktemp("images")
    dataset = load_dataset("digits-test", root="data")
    files = []
    for i in SHOWN:
        image, _, index = dataset[i]
        assert index == i
        image.save(root / f"digit{i}.png")
        files.append(root / f"digit{i}.png")
    noise = np.random.default_rng(0).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    Image.fromarray(noise).save(root / "noise.png")
    (root / "broken.png").write_bytes(b"not an image")
    return files + [root / "noise.png", root / "broken.png"]


def test_oodviz_score_writes_each_images_prediction_score_percentile_and_verdict(
    default_run, default_results, image_files, tmp_path
):
    result = oodviz_score(default_run.path, *image_files, "--out", tmp_path / "scores.csv", cwd=tmp_path)
    assert result.returncode == 1, result.stderr  # one file unreadable, the others scored
    assert f"unreadable: {image_files[-1]}" in result.stderr
    table = pd.read_csv(tmp_path / "scores.csv")
    assert tuple(table.columns) == SCORED_COLUMNS
    names = list(default_results.detectors)
    assert list(table.file.unique()) == [str(f) for f in image_files[:-1]]
    assert list(table.detector.unique()) == names and len(table) == 4 * len(names)
    scores = default_results.scores
    id_rows = scores[scores.split == ID_SPLIT].set_index("index")
    ood_rows = scores[scores.split == OOD_SPLIT]
    classes = default_results.class_names
    for name in names:
        rows = table[table.detector == name].set_index("file")
        id_scores = id_rows[name].to_numpy(dtype=np.float64)
        # the threshold: the highest t flagging >= 95% of the run's OOD samples (brute force)
        ood = np.sort(ood_rows[name].to_numpy(dtype=np.float64))
        threshold = max(t for t in ood if np.mean(ood >= t) >= 0.95)
        for i, file in zip(SHOWN, image_files, strict=False):
            row = rows.loc[str(file)]
            assert row.prediction == id_rows.loc[i, "prediction"] and str(row.class_name) == classes[row.prediction]
            # the same image as in the run: the same score (a batch of 3 instead of 256: float rounding only)
            assert row.score == pytest.approx(float(id_rows.loc[i, name]), rel=1e-5, abs=1e-6), name
        for file, row in rows.iterrows():
            assert row.id_percentile == pytest.approx(100 * np.mean(id_scores <= row.score), abs=1e-9)
            assert row.threshold == pytest.approx(threshold, rel=1e-12)
            assert row.verdict == ("OOD" if row.score >= threshold else "ID"), (file, name)
    # A random-colour noise image is far from every digit for the best detector of the run
    assert table[(table.detector == "mahalanobis") & table.file.str.endswith("noise.png")].verdict.item() == "OOD"


def test_a_file_name_that_is_not_utf8_is_named_and_the_other_files_are_scored(default_run, image_files, tmp_path):
    """A valid PNG whose name holds the byte 0xff, among readable files: it is reported by name (the byte shown as
    ``\\xff``), the others are scored, exit 1."""
    bad = os.fsencode(tmp_path) + b"/bad\xff.png"
    descriptor = os.open(bad, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(descriptor, image_files[0].read_bytes())
    os.close(descriptor)
    files = [image_files[0], os.fsdecode(bad), image_files[1]]
    result = oodviz_score(default_run.path, *files, "--detector", "msp", "--out", tmp_path / "scores.csv", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"unreadable: {tmp_path}/bad\\xff.png: its name is not UTF-8 text" in result.stderr, result.stderr
    assert list(pd.read_csv(tmp_path / "scores.csv").file) == [str(image_files[0]), str(image_files[1])]


def test_oodviz_score_one_detector_printed(default_run, image_files, tmp_path, capsys, monkeypatch):
    """In process (``main``, as the refusals below): the test above runs the command itself."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["score", str(default_run.path), str(image_files[0]), "--detector", "energy"]) == 0
    printed = capsys.readouterr()
    lines = printed.out.strip().splitlines()
    assert lines[0].split() == list(SCORED_COLUMNS) and len(lines) == 2 and " energy " in lines[1]
    assert "higher = more OOD" in printed.err


def test_oodviz_score_refuses_what_it_cannot_score(default_run, image_files, tmp_path, capsys, monkeypatch):
    """In process (``main``): the refusals happen before any model runs, and two tests run the command itself."""

    def refused(*args) -> str:
        code = cli_main(["score", *map(str, args)])
        stderr = capsys.readouterr().err
        assert code == 2, stderr
        return stderr

    monkeypatch.chdir(tmp_path)
    assert "No scores for detector 'nonesuch'; this run has: msp" in refused(
        default_run.path, image_files[0], "--detector", "nonesuch"
    )
    copy = tmp_path / "old-run"
    shutil.copytree(default_run.path, copy)
    shutil.rmtree(copy / "detectors")
    assert "has no saved detectors" in refused(copy, image_files[0])
    shutil.copytree(detectors_dir(default_run.path), copy / "detectors")
    identity = (copy / "detectors" / BACKBONE_FILE).read_text()
    (copy / "detectors" / BACKBONE_FILE).write_text(identity.replace('"weights_id": "', '"weights_id": "other-'))
    assert "weights_id changed" in refused(copy, image_files[0])
    assert "is not finished" in refused(tmp_path / "no-such-run", image_files[0])


def test_scores_of_the_model_detectors_match_the_run(default_run, default_results, image_files):
    """odin runs the model again on the transformed image: the same score as in the run for the same image."""
    from oodviz.pipeline.scoring import score_images

    scored = score_images(default_run.path, image_files[:1], detector="odin")
    stored = default_results.scores
    expected = stored[(stored.split == ID_SPLIT) & (stored["index"] == SHOWN[0])]["odin"].item()
    assert scored.table.score.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_oodviz_score_scores_with_the_detectors_that_load_and_says_why_the_others_did_not(
    default_run, default_results, image_files, tmp_path
):
    """knn's manifest removed, a mahalanobis state file changed, vim's residual space re-hashed with another shape,
    energy never saved (its ``save_error`` in detectors.json): those four are named with why, every other detector gives the score it gives when every
    detector loads."""
    import json

    copy = tmp_path / "damaged"
    shutil.copytree(default_run.path, copy)
    saved = copy / "detectors"
    (saved / "knn" / "detector.json").unlink()
    state = next(p for p in (saved / "mahalanobis").iterdir() if p.suffix in (".npy", ".safetensors"))
    state.write_bytes(state.read_bytes()[:-8] + b"\0" * 8)
    rehash_with(saved / "vim", "residual_space_", np.load(saved / "vim" / "residual_space_.npy")[:-1])
    shutil.rmtree(saved / "energy")
    log = json.loads((copy / "detectors.json").read_text())
    log["energy"]["save_error"] = "OSError: [Errno 28] No space left on device"
    (copy / "detectors.json").write_text(json.dumps(log))

    # the command's code in this process: test_oodviz_score_writes_each_images... starts its process
    result = oodviz_in_process("score", copy, image_files[0], "--out", tmp_path / "s.csv", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "not loaded: knn: DetectorFileError:" in result.stderr and "does not exist" in result.stderr
    assert "not loaded: mahalanobis: DetectorFileError:" in result.stderr and "changed" in result.stderr
    assert "not loaded: vim: DetectorFileError:" in result.stderr and "(fitted state residual_space_)" in result.stderr
    assert "not loaded: energy: the run could not save it (OSError: [Errno 28]" in result.stderr
    table = pd.read_csv(tmp_path / "s.csv")
    expected = [n for n in default_results.detectors if n not in ("knn", "mahalanobis", "vim", "energy")]
    assert list(table.detector) == expected
    from oodviz.pipeline.scoring import score_images

    intact = score_images(default_run.path, image_files[:1])  # every detector loads: what the command scores
    assert not intact.not_loaded and not intact.unreadable
    intact.table.to_csv(tmp_path / "all.csv", index=False)  # as ``oodviz score --out`` writes it
    reference = pd.read_csv(tmp_path / "all.csv").set_index("detector").loc[expected]
    assert np.array_equal(table.score.to_numpy(), reference.score.to_numpy())

    for name in expected:  # none left: the run cannot score, each reason said
        shutil.rmtree(saved / name)
    result = oodviz_in_process("score", copy, image_files[0], cwd=tmp_path)
    assert (
        result.returncode == 2
        and "no saved detector of run" in result.stderr
        and "knn: DetectorFileError" in result.stderr
    )
