"""Read only what is used (issue 13.6): a run's fits and scores read from the feature store only the fields
each detector declares."""

import pandas as pd

from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.detectors import available, detector_class
from oodviz.engine.store import batches as store_batches
from oodviz.pipeline.reporter import Reporter
from oodviz.pipeline.stages import run_pipeline
from oodviz.runs.rundir import RunDir


def test_every_detector_reads_its_declared_fields_only():
    for name in available():
        cls = detector_class(name)
        if cls.needs_model:
            continue
        for fitting in (True, False):
            fields = cls.fields_to_read(fitting)
            assert set(fields) <= {"features", "logits", "labels"}
            assert "labels" not in fields or (fitting and cls.needs_labels) or "labels" in cls.inputs
    assert detector_class("tempscale").fields_to_read(fitting=True) == ("logits", "labels")
    assert detector_class("tempscale").fields_to_read(fitting=False) == ("logits",)
    assert detector_class("mahalanobis").fields_to_read(fitting=True) == ("features", "labels")
    assert detector_class("vim").fields_to_read(fitting=False) == ("features", "logits")


def test_a_run_reads_from_the_store_only_the_fields_its_detectors_use(tmp_path, monkeypatch):
    opened = []  # the fields of every stream over a store, as its rows are read (positioned reads per file)
    read_bytes = {}
    open_files, read_rows = store_batches.StoreBatches._open, store_batches._RowFile.read

    def opening(self):
        opened.append((tuple(sorted(self.include)), self.n))
        return open_files(self)

    def reading(self, start, stop, out=None):
        name = self.file.name.rsplit("/", 1)[-1]
        read_bytes[name] = read_bytes.get(name, 0) + (stop - start) * self.row_bytes
        return read_rows(self, start, stop, out)

    monkeypatch.setattr(store_batches.StoreBatches, "_open", opening)
    monkeypatch.setattr(store_batches._RowFile, "read", reading)
    config = RunConfig(
        ood=[DatasetChoice("noise-uniform", params={"n": 100})],
        detectors=[DetectorChoice("tempscale"), DetectorChoice("energy"), DetectorChoice("mahalanobis")],
        batch_size=128,
    ).validate()
    run = RunDir.create(tmp_path, config.to_dict())
    run_pipeline(config, run, Reporter(run))
    assert list(pd.read_parquet(run.path / "scores.parquet").columns[5:]) == ["tempscale", "energy", "mahalanobis"]
    # tempscale's fit (every Newton step), energy and tempscale's scores, mahalanobis's fit and scores
    assert {fields for fields, _ in opened} == {
        ("labels", "logits"),
        ("logits",),
        ("features", "labels"),
        ("features",),
    }
    passes = {fields: sum(1 for f, _ in opened if f == fields) for fields in {f for f, _ in opened}}
    assert passes[("features", "labels")] == 1 and passes[("features",)] == 2  # id_test and the OOD split
    assert passes[("labels", "logits")] >= 3  # tempscale's Newton steps, none of them reading features
    feature_rows = sum(n for fields, n in opened if "features" in fields)
    assert read_bytes["features.npy"] == feature_rows * 64 * 4  # digits-cnn: D = 64, float32
