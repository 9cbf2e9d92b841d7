"""The model's classes against the ID labels, before any extraction (oodviz/pipeline/classifier_check.py): the rule
against scipy's binomial tail, the bundled model passing, a model whose head is permuted failing, and a run on an
image folder whose classes are not the model's refused by ``oodviz run`` (exit 2, nothing created) until
``--force``, which runs it with the warning in its log and on its page."""

import json
from pathlib import Path

import pytest
import torch
from helpers import oodviz_in_process, small_config
from scipy.stats import binom
from streamlit.testing.v1 import AppTest

from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.data import load_dataset
from oodviz.models import Backbone
from oodviz.pipeline.classifier_check import CHANCE_TAIL, ClassifierCheck, check_classifier
from oodviz.runs.rundir import RunDir

APP = str(Path(__file__).resolve().parents[2] / "app.py")


@pytest.mark.parametrize(("classes", "n", "correct"), [(10, 64, 16), (10, 64, 15), (10, 64, 6), (2, 64, 45), (8, 3, 3)])
def test_the_chance_tail_is_the_binomial_upper_tail(classes, n, correct):
    check = ClassifierCheck(classes, n, correct)
    expected = binom.sf(correct - 1, n, 1 / classes)  # P(X >= correct)
    assert check.chance_tail == pytest.approx(expected, rel=1e-9)
    assert check.matches == (expected < CHANCE_TAIL)


def test_what_matches_and_what_does_not():
    assert ClassifierCheck(10, 64, 16).matches  # 25% on 10 classes: a weak model, but a real one
    assert not ClassifierCheck(10, 64, 0).matches  # the 0.000 accuracy of a checkpoint for other classes
    assert not ClassifierCheck(10, 64, 7).matches  # chance
    assert ClassifierCheck(10).matches and ClassifierCheck(1, 5, 0).matches  # nothing to judge by
    names = ClassifierCheck(8, names="2 of the 3 ID classes are not classes of the model: 'a', 'b'. ...")
    assert not names.matches and names.problem().startswith("The model's classes are not the ID labels: 2 of the 3")
    problem = ClassifierCheck(10, 64, 3).problem()
    assert problem.startswith("The model's classes do not look like the ID labels: it predicts 3 of 64 sampled ID")
    assert "(4.7%), no better than chance (10.0% for its 10 classes)" in problem
    assert ClassifierCheck(10, 64, 40).problem() is None


def test_the_bundled_model_passes_and_the_same_model_with_its_head_rolled_fails():
    backbone, dataset = RunConfig().load_backbone(), load_dataset("digits-train")
    check = check_classifier(backbone, dataset, seed=0)
    assert check.names is None and check.n == 64 and check.correct >= 60 and check.matches
    with torch.no_grad():  # class k's scores now predict class k + 1: every label one off
        head = backbone.model.fc
        head.weight.copy_(head.weight.roll(1, dims=0))
        head.bias.copy_(head.bias.roll(1))
    unnamed = Backbone(  # the same model as a user's checkpoint without class names: the accuracy decides
        "rolled",
        backbone.model,
        backbone.transform,
        input_shape=backbone.input_shape,
        weights_id="rolled",
        head_module="fc",
    )
    rolled = check_classifier(unnamed, dataset, seed=0)
    assert rolled.n == 64 and rolled.correct <= 4 and not rolled.matches
    again = check_classifier(unnamed, dataset, seed=0)
    assert (again.n, again.correct) == (rolled.n, rolled.correct)  # seeded


def test_an_id_set_without_classes_has_nothing_to_judge_by():
    """Generated noise as the ID set (labels -1, no classes), as tests/pipeline/test_batchprobe.py measures odin on."""
    check = check_classifier(RunConfig().load_backbone(), load_dataset("noise-uniform", n=20), seed=0)
    assert (check.n, check.names) == (0, None) and check.matches


def _lettered_digits(root: Path, n_per_class: int = 12) -> Path:
    """The bundled digits 0-3 as an image folder whose classes are named a-d: not the model's class names."""
    images = load_dataset("digits-test")
    counts = dict.fromkeys(range(4), 0)
    for i in range(len(images)):
        image, label, _ = images[i]
        if label in counts and counts[label] < n_per_class:
            folder = root / "abcd"[label]
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{i}.png")
            counts[label] += 1
    return root


def test_oodviz_run_refuses_a_folder_whose_classes_are_not_the_models_until_forced(tmp_path, monkeypatch):
    folder = _lettered_digits(tmp_path / "letters")
    config = small_config(
        id_fit=DatasetChoice("folder", {"path": str(folder)}),
        id_test=DatasetChoice("folder", {"path": str(folder)}),
        ood=[DatasetChoice("noise-uniform", params={"n": 40})],
        detectors=[DetectorChoice("msp"), DetectorChoice("mahalanobis")],
    )
    config.save(tmp_path / "letters.json")
    runs = tmp_path / "runs"
    refused = oodviz_in_process("run", tmp_path / "letters.json", "--runs-root", runs, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "The model's classes are not the ID labels: 4 of the 4 ID classes are not classes of the model" in (
        refused.stderr
    )
    assert "nothing was started; run with --force to start anyway" in refused.stderr
    assert not runs.exists() or not any(p for p in runs.iterdir() if not p.name.startswith("."))
    forced = oodviz_in_process("run", tmp_path / "letters.json", "--runs-root", runs, "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    [run_dir] = [p for p in runs.iterdir() if not p.name.startswith(".")]
    warnings = [e["message"] for e in RunDir(run_dir).read_events() if e["event"] == "warning"]
    assert any("are not classes of the model" in w for w in warnings)
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(runs))  # the run's page carries the warning above its results
    app = AppTest.from_file(APP, default_timeout=120)
    app.query_params["run"] = run_dir.name
    app.run()
    assert not app.exception
    assert any("are not classes of the model" in w.value for w in app.warning)
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    from oodviz.figures.report import report_html

    report = report_html(run_dir, detectors=["msp"])
    assert '<p class="warning">Warning: The model&#x27;s classes are not the ID labels: 4 of the 4' in report
