"""Pre-flight (issue 13.1): a run's needs against the machine's disk, RAM and GPU, before any extraction;
``oodviz run`` refuses over the limit (exit 2, nothing written) and ``--force`` starts anyway."""

import json

import pytest
from helpers import VIT_BLOCK_POOLINGS

import oodviz.pipeline.worker
from oodviz.cli import main
from oodviz.config.run import DetectorChoice, RunConfig
from oodviz.engine.store.space import MARGIN_BYTES, MARGIN_FRACTION, margin_for
from oodviz.models.memory import format_bytes
from oodviz.pipeline.preflight import WIDE_FEATURES, assess
from oodviz.problems import Fix, smaller_batch

GiB = 2**30
# The issue's case: ViT-B/16's last encoder block unpooled, 197 tokens x 768 = 151,296 features per image.
VIT_UNPOOLED = {
    "backbone": "vit_b_16",
    "weights": "random",
    "layer": "encoder.layers.encoder_layer_11",
    "pooling": "none",
    "device": "cpu",
    "id_fit": {"name": "noise-uniform", "params": {"n": 50_000, "size": 224}},
    "id_test": {"name": "noise-uniform", "params": {"n": 1_000, "size": 224}},
    "ood": [{"name": "noise-gaussian", "params": {"n": 1_000, "size": 224}}],
    "detectors": ["msp", "mahalanobis", "knn", "klm"],
}


def estimate_of(d: int, c: int, sizes: dict, dtype_bytes: int = 4, pooled: int | None = None) -> dict:
    """A store estimate written out from the formula: N x (D x b + C x 4 + 3 x 8) bytes per split."""
    splits = {s: {"n_samples": n, "total_bytes": n * (d * dtype_bytes + c * 4 + 24)} for s, n in sizes.items()}
    return {
        "feature_dim": d,
        "num_classes": c,
        "pooled_dim": pooled or d,
        "raw_feature_shape": None if pooled is None else (d // pooled, pooled),
        "pooling": "none" if pooled else "avg",
        "default_pooling": "cls"
        if pooled
        else "avg",  # unpooled: a ViT block's tokens, whose head reads the class token
        "feature_dtype": "float32" if dtype_bytes == 4 else "float16",
        "splits": splits,
    }


def config_with(*detectors, **params) -> RunConfig:
    return RunConfig(detectors=[DetectorChoice(name, params.get(name, {})) for name in detectors])


def test_the_needs_are_the_store_and_each_fit_from_d_c_and_n():
    d, c, n_fit, n_test = 2048, 100, 10_000, 2_000
    estimate = estimate_of(d, c, {"id_fit": n_fit, "id_test": n_test})
    config = config_with("mahalanobis", "rmd", "vim", "klm", "knn", "msp", knn={"chunk_size": 1000})
    report = assess(config, estimate, {"disk": 10**12, "ram": 10**12, "gpu": 10**12})
    disk = [need for need in report.needs if need.resource == "disk"]
    stores = (n_fit + n_test) * (d * 4 + c * 4 + 24)  # knn's bank: the store
    assert [need.needed for need in disk] == [stores + max(MARGIN_BYTES, int(MARGIN_FRACTION * stores))]
    for resource in ("ram", "gpu"):
        fits = {need.what.split()[1]: need.needed for need in report.needs if need.resource == resource}
        assert fits == {
            "mahalanobis": int(8 * (2.5 * d * d + 2 * c * d)),
            "rmd": int(8 * (3.5 * d * d + 2 * c * d)),
            "vim": int(8 * (d * d + 1.5 * d * (d - 1000))),  # the residual space [D, D - 1000] at D=2048
            "klm": 8 * 2 * c * c,
            "knn": 1000 * d * 4,
        }  # msp has no fit: no row
    assert report.fits and report.fixes == []


def test_over_the_ram_names_the_detectors_and_the_fixes():
    d, pooled = 197 * 768, 768
    config = config_with("mahalanobis", "klm", "energy")
    ram = 16 * GiB
    # 96 rows of D = 151,296: mahalanobis takes the Gram path (N <= D / 2), about 0.3 GiB, not the D x D covariance
    few = assess(
        config, estimate_of(d, 1000, {"id_fit": 96, "id_test": 96}, pooled=pooled), {"disk": 10**12, "ram": ram}
    )
    assert few.fits
    estimate = estimate_of(d, 1000, {"id_fit": 100_000, "id_test": 96}, pooled=pooled)  # N > D / 2: streamed
    report = assess(config, estimate, {"disk": 10**15, "ram": ram})
    assert [need.what.split()[1] for need in report.over] == ["mahalanobis"]
    assert report.over[0].needed == int(8 * (2.5 * d * d + 2 * 1000 * d))
    text = report.message()
    assert "the model's own: 'cls' (the class token), gives D=768 instead of 151,296" in text
    assert "leave out mahalanobis" in text and "klm" not in text.split("leave out")[1]
    assert format_bytes(report.over[0].needed) in text and format_bytes(ram) in text and "OVER" in text


def test_disk_over_the_free_space_suggests_float16_and_subsampling():
    estimate = estimate_of(512, 10, {"id_fit": 1_000_000, "id_test": 10_000})
    report = assess(config_with("msp"), estimate, {"disk": GiB, "ram": 10**12})
    assert [need.resource for need in report.over] == ["disk"]
    assert "feature_dtype='float16'" in report.message() and "id_fit: 1,000,000 samples" in report.message()
    assert "pool the features" not in report.message()  # already pooled


def test_wide_features_name_the_square_state_detectors_even_when_they_fit():
    d = WIDE_FEATURES + 1
    report = assess(
        config_with("vim", "msp"), estimate_of(d, 10, {"id_fit": 10, "id_test": 10}), {"disk": 10**15, "ram": 10**15}
    )
    assert report.fits
    assert [(fix.kind, fix.text) for fix in report.fixes] == [
        ("advice", f"at D={d:,} the D x D state of vim is large: pool or leave them out")
    ]


def test_memory_budget_is_an_optional_cap_none_by_default():
    assert RunConfig().memory_budget_gb is None
    assert RunConfig(memory_budget_gb=None).problems() == []
    assert "memory_budget_gb must be a positive number, got 0" in " ".join(RunConfig(memory_budget_gb=0).problems())


@pytest.fixture(scope="module")
def vit_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("vit") / "vit.json"
    path.write_text(json.dumps(VIT_UNPOOLED))
    return str(path)


def test_the_unpooled_vit_run_is_refused_before_anything_is_written(tmp_path, capsys, vit_config):
    runs_root = tmp_path / "runs"
    code = main(["run", vit_config, "--runs-root", str(runs_root)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not runs_root.exists()
    d, c = 197 * 768, 1000
    assert f"fit mahalanobis (D={d:,}, C={c:,}, N=50,000)" in err
    # 50,000 rows <= D / 2: the Gram path, the kept rows (28 GiB) and the 50,000 x 50,000 Gram matrix, with slack
    n = 50_000
    gram = 4 * n * d + max(16 * n * n, 8 * n * n + 4 * n * d) + 2 * 4 * 2**20
    assert format_bytes(int(2.0 * gram + 16 * c * d)) in err
    assert "the model's own: 'cls' (the class token), gives D=768 instead of 151,296" in err
    assert "--force" in err


def test_force_starts_the_unpooled_vit_run(tmp_path, capsys, vit_config, monkeypatch):
    started = []

    class Started(Exception):
        pass

    def execute(run, echo=None, pipeline=None):  # the run itself would extract 52,000 ViT images: stop where it starts
        started.append(run.path)
        raise Started

    monkeypatch.setattr(oodviz.pipeline.worker, "execute", execute)
    runs_root = tmp_path / "runs"
    with pytest.raises(Started):
        main(["run", vit_config, "--runs-root", str(runs_root), "--force"])
    assert "--force: running anyway" in capsys.readouterr().err
    assert len(started) == 1 and started[0].parent == runs_root
    assert json.loads((started[0] / "config.json").read_text())["pooling"] == "none"


def test_force_runs_a_small_run_over_a_tiny_disk_cap_to_the_end(tmp_path, capsys):
    config = {"backbone": "digits-cnn", "device": "cpu", "ood": ["digits-heldout"], "detectors": ["msp"]}
    path = tmp_path / "small.json"
    path.write_text(json.dumps({**config, "memory_budget_gb": 1e-6}))  # a 1 KiB cap: the stores are over it
    runs_root = tmp_path / "runs"
    assert main(["run", str(path), "--runs-root", str(runs_root)]) == 2
    assert "OVER" in capsys.readouterr().err and not runs_root.exists()
    assert main(["run", str(path), "--runs-root", str(runs_root), "--force"]) == 0
    (run,) = [p for p in runs_root.iterdir() if not p.name.startswith(".")]  # .features: the shared stores
    assert (run / "metrics.csv").is_file()


def test_the_app_refuses_start_over_the_limit_unless_run_anyway(tmp_path, monkeypatch, app_subprocesses_in_process):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    import oodviz.ui.new_run
    from oodviz.runs.jobs import QueueFull

    submitted = []

    def submit(
        config, root, nproc_per_node=1
    ):  # the real run would extract every digit through ViT-B/16: record, refuse
        submitted.append(config)
        assert nproc_per_node == 1  # no GPUs here: one process
        raise QueueFull("test: recorded, not queued")

    monkeypatch.setattr(oodviz.ui.new_run, "submit", submit)
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path / "runs"))
    app = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=120)
    app.run()
    [box for box in app.selectbox if box.label == "Backbone"][0].set_value("vit_b_16").run()  # its layers
    layers = [layers for layers in app.multiselect if layers.label == "Layers"][0]
    layers.set_value([VIT_UNPOOLED["layer"]]).run()  # the layer's pooling field, its choices those of a token layer
    [radio for radio in app.radio if radio.label == "Weights"][0].set_value("random")
    pooling = [box for box in app.selectbox if box.label == "Pooling"][0]
    assert pooling.value is None and pooling.options == VIT_BLOCK_POOLINGS
    [box for box in app.selectbox if box.label == "Pooling"][0].set_value("none")
    start = [button for button in app.button if button.label == "Start run"][0]
    start.click().run()
    assert not app.exception
    shown = " ".join(w.value for w in app.warning)  # the fixes
    assert "own: 'cls' (the class token), gives D=768 instead of 151,296" in shown
    [needs] = [d.value for d in app.dataframe if "needed" in d.value.columns]  # the needs, those over first
    over = needs[needs[""] == "OVER"]
    assert list(needs[""]) == ["OVER"] * len(over) + ["fits"] * (len(needs) - len(over))
    # vim's D x D state is over; mahalanobis, on 1,081 rows of 151,296 features, takes the Gram path and fits
    assert list(over.what) == ["fit vim (D=151,296, C=1,000, N=1,081)"]
    assert needs.what.str.startswith("fit mahalanobis (D=151,296").any()
    assert any(e.value.startswith("Does not fit this machine: fit vim (D=151,296") for e in app.error)
    assert any("Not started" in e.value for e in app.error) and submitted == []

    def button(label):
        return [b for b in app.button if b.label == label][0]

    assert button("Start run").disabled  # over the limit: Start is off, the fixes are buttons
    assert not button("Estimate memory").disabled
    [box for box in app.checkbox if box.label.startswith("Run anyway")][0].check().run()
    assert not button("Start run").disabled
    button("Start run").click().run()
    assert [c.pooling for c in submitted] == ["none"]
    assert any("recorded, not queued" in e.value for e in app.error)
    button("Fix: Pool the features (the model's own pooling)").click().run()  # fills the form, estimates it again
    assert not app.exception
    assert [box for box in app.selectbox if box.label == "Pooling"][0].value is None  # the model's own: cls
    assert [layers for layers in app.multiselect if layers.label == "Layers"][0].value == [VIT_UNPOOLED["layer"]]
    assert any(s.value.startswith("Applied: Pool the features") for s in app.success)
    assert any(s.value == "Fits this machine's free disk, RAM and GPU memory." for s in app.success)
    assert not button("Start run").disabled and not [b for b in app.button if b.label.startswith("Fix:")]


def test_a_run_over_several_layers_is_told_to_pool_its_widest_layer():
    """The main (first) layer is pooled already; the unpooled ViT block beside it is what pooling shrinks."""
    block = VIT_UNPOOLED["layer"]
    sizes = {"id_fit": 100_000, "id_test": 100, "ood:noise": 100}  # N > D / 2: mahalanobis streams a D x D state
    config = RunConfig(pooling="none", layers=["penultimate", block], detectors=[DetectorChoice("mahalanobis")])
    layers = {
        "penultimate": (estimate_of(768, 1000, sizes), list(sizes)),
        block: (estimate_of(151_296, 1000, sizes, pooled=768), list(sizes)),
    }
    report = assess(config, layers["penultimate"][0], {"disk": 10**15, "ram": 16 * GiB}, layers=layers)
    assert [need.what.split()[1] for need in report.over] == [f"mahalanobis@{block}"]
    assert report.fixes[0] == Fix(
        "pooling",
        "pool the features: leaving pooling unset, the model's own: 'cls' (the class token), gives D=768 instead of "
        "151,296 (197 x 768 per sample, 197x smaller); so do 'avg', 'max' and 'mean' (of the patch tokens)",
        None,
    )
    assert Fix("drop_layer", f"fewer layers: the widest is {block} (D=151,296)", block) in report.fixes


def test_the_fixes_a_refusal_names_become_changes_of_the_form():
    """Each fix of a pre-flight refusal (or a failed run's status) is the form with one change: pooled, every split
    at most half the largest, float16, the detectors over the memory left out, a quarter of the batch; read from
    the fix's kind and value, never from its words."""
    from dataclasses import replace

    from oodviz.ui.form import FormValues, form_fixes

    config = RunConfig(
        pooling="none", detectors=[DetectorChoice("msp"), DetectorChoice("mahalanobis"), DetectorChoice("energy")]
    )
    estimate = estimate_of(151_296, 1000, {"id_fit": 50_000, "id_test": 1_000, "ood:noise": 1_000}, pooled=768)
    report = assess(config, estimate, {"disk": 8 * GiB, "ram": 16 * GiB})
    values = FormValues(pooling="none", detectors=["msp", "mahalanobis", "energy"], test_subsample=500)
    fixes = form_fixes(report.fixes, values)
    assert [(f.label, f.values) for f in fixes] == [
        ("Pool the features (the model's own pooling)", replace(values, pooling=None)),
        (
            "Subsample every split to at most 25,000 images",
            replace(values, fit_subsample=25_000, test_subsample=500, ood_subsample=25_000),
        ),
        ("Store the features as float16", replace(values, feature_dtype="float16")),
        ("Leave out mahalanobis", replace(values, detectors=["msp", "energy"])),
    ]
    applied = fixes[0].values
    assert "Pool the features (the model's own pooling)" not in [f.label for f in form_fixes(report.fixes, applied)]
    oom = smaller_batch(256, "killed by the OOM killer")
    assert [(f.label, f.values.batch_size) for f in form_fixes([oom], values)] == [("Batch size 256 → 64", 64)]
    assert form_fixes([Fix("advice", "choose another layer")], values) == []
    only = replace(values, detectors=["mahalanobis"])
    assert form_fixes([Fix("drop_detectors", "leave out mahalanobis", ["mahalanobis"])], only) == []


def test_rewording_every_fix_changes_no_button_and_no_config():
    """A translation hook: every fix's sentence rewritten; each button still makes the same change of the form,
    and each fix the same change of the config (:meth:`Fix.apply`, compared with the config changed by hand)."""
    from dataclasses import replace

    from oodviz.ui.form import FormValues, form_fixes

    config = RunConfig(
        pooling="none",
        layers=["features.0", "penultimate"],
        detectors=[DetectorChoice("msp"), DetectorChoice("mahalanobis"), DetectorChoice("energy")],
    )
    sizes = {"id_fit": 50_000, "id_test": 1_000, "ood:noise": 1_000}
    layers = {"features.0": (estimate_of(151_296, 1000, sizes, pooled=768), list(sizes))}
    layers["penultimate"] = (estimate_of(768, 1000, sizes), list(sizes))
    report = assess(config, layers["features.0"][0], {"disk": 8 * GiB, "ram": 16 * GiB}, layers=layers)
    kinds = {fix.kind for fix in report.fixes}
    assert {"pooling", "drop_layer", "subsample", "feature_dtype", "drop_detectors"} <= kinds
    reworded = [replace(fix, text=f"(sentence {i} in another language)") for i, fix in enumerate(report.fixes)]
    values = FormValues(
        pooling="none", layers=["features.0", "penultimate"], detectors=["msp", "mahalanobis", "energy"]
    )
    assert [f.values for f in form_fixes(reworded, values)] == [f.values for f in form_fixes(report.fixes, values)]
    assert len(form_fixes(reworded, values)) == len(kinds - {"advice"})
    by_hand = {
        "pooling": replace(config, pooling=None),  # the model's own
        "drop_layer": replace(config, layers=["penultimate"]),
        "feature_dtype": replace(config, feature_dtype="float16"),
        "drop_detectors": replace(config, detectors=[DetectorChoice("msp"), DetectorChoice("energy")]),
    }
    for fix in reworded:
        changed = fix.apply(config)
        if fix.kind == "advice":
            assert changed is None
        elif fix.kind == "subsample":
            every = [changed.id_fit, changed.id_test, *changed.ood]
            assert [choice.subsample for choice in every] == [25_000] * len(every)
        else:
            assert changed == by_hand[fix.kind], fix.kind
        assert Fix.from_dict(json.loads(json.dumps(fix.to_dict()))) == fix  # as the probe's JSON carries it


def digits_layer_stores() -> tuple[dict, int, dict, dict]:
    """digits-cnn over two layers: each layer's D (avg-pooled: one per channel) from a hook, C, each layer's
    stores written out from the formula, N x (D x 4 + C x 4 + 24) bytes summed over the run's 3 splits, and
    the run's settings."""
    import torch

    from oodviz.data import load_dataset
    from oodviz.models.digits import DigitsCNN

    model = DigitsCNN()
    seen = {}
    model.features[3].register_forward_hook(lambda module, inputs, output: seen.update(channels=output.shape[1]))
    model(torch.zeros(1, 1, 8, 8))
    dims = {"features.3": seen["channels"], "penultimate": model.fc.in_features}
    c = model.fc.out_features
    sizes = [len(load_dataset(name)) for name in ("digits-train", "digits-test", "digits-heldout")]
    store = {layer: sum(n * (d * 4 + c * 4 + 24) for n in sizes) for layer, d in dims.items()}
    settings = {
        "backbone": "digits-cnn",
        "device": "cpu",
        "layers": list(dims),
        "ood": ["digits-heldout"],
        "detectors": ["mahalanobis", "msp"],
    }
    return dims, c, store, settings


def test_the_run_checks_the_free_disk_for_every_layers_new_stores(tmp_path, monkeypatch):
    """``load data`` refuses a run over several layers when the free disk holds less than every layer's new
    stores plus the margin (the main layer's alone would fit), and starts with exactly that much free."""
    import oodviz.engine.store.space
    from oodviz.engine import DiskFullError
    from oodviz.pipeline import stages as pipeline
    from oodviz.pipeline.reporter import Reporter
    from oodviz.runs.rundir import RunDir

    _, _, store, settings = digits_layer_stores()
    needed = sum(store.values())
    enough = needed + max(MARGIN_BYTES, int(MARGIN_FRACTION * needed))
    assert enough - 1 > max(store.values()) + max(MARGIN_BYTES, int(MARGIN_FRACTION * max(store.values())))
    config = RunConfig.from_dict(settings)
    for free in (enough - 1, enough):
        monkeypatch.setattr(oodviz.engine.store.space, "free_bytes", lambda root, free=free: free)
        run = RunDir.create(tmp_path / str(free), config.to_dict())
        job = pipeline.start_job(config, run, Reporter(run))
        pipeline.load_model(job)
        if free < enough:
            with pytest.raises(DiskFullError, match=f"^disk full: needed ~{format_bytes(enough)}"):
                pipeline.load_data(job)
        else:
            pipeline.load_data(job)
            assert set(job.datasets) == {"id_fit", "id_test", "ood:digits-heldout"}


def test_a_run_over_several_layers_needs_the_stores_and_fits_of_every_layer(tmp_path, capsys):
    """Two layers of digits-cnn: the disk need is both layers' stores, each layer's mahalanobis fit is at that
    layer's D; a disk cap between one layer's stores and both refuses the run (``oodviz run``, exit 2)."""
    from oodviz.models.memory import describe_memory
    from oodviz.pipeline.preflight import preflight

    dims, c, store, settings = digits_layer_stores()
    report = preflight(RunConfig.from_dict(settings), tmp_path / "runs")
    (disk,) = [need for need in report.needs if need.resource == "disk"]
    both = store["features.3"] + store["penultimate"]
    assert disk.needed == both + max(MARGIN_BYTES, int(MARGIN_FRACTION * both))
    assert f"features.3: D={dims['features.3']}, 3/3 splits, {format_bytes(store['features.3'])}" in disk.what
    fits = {need.what.split()[1]: need.needed for need in report.needs if need.resource == "ram"}
    assert fits == {f"mahalanobis@{layer}": int(8 * (2.5 * d * d + 2 * c * d)) for layer, d in dims.items()}
    described = describe_memory(report.estimate)  # the app's estimate beside Start
    assert f"layer penultimate (D={dims['penultimate']}): {format_bytes(store['penultimate'])}" in described
    assert f"feature store total (2 layers): {format_bytes(both)}" in described
    # the cap lets either layer's stores through (with the head room), not both
    cap = (max(store.values()) + margin_for(max(store.values())) + disk.needed) / 2
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({**settings, "memory_budget_gb": cap / GiB}))
    assert main(["run", str(path), "--runs-root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "feature stores, 2 layers" in err and "OVER" in err and not (tmp_path / "runs").exists()
    # started anyway: the run says the same in its warnings, and runs to the end
    assert main(["run", str(path), "--runs-root", str(tmp_path / "runs"), "--force"]) == 0
    (run,) = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    warned = [e["message"] for e in events if e.get("event") == "warning" and "does not fit" in e["message"]]
    assert len(warned) == 1 and "feature stores, 2 layers" in warned[0] and "mahalanobis@features.3" in warned[0]


def test_the_pre_flight_and_the_run_ask_for_the_same_free_disk(tmp_path, monkeypatch):
    """One disk need (:func:`oodviz.pipeline.preflight.store_disk_need`: the new stores and the head room): with one
    byte less free the pre-flight refuses and the run's own check before extraction fails, with that much both
    go on (the pre-flight accepted 6.95 MiB of stores on a disk the run then refused for wanting ~22.9 MiB)."""
    import oodviz.engine.store.space
    from oodviz.engine import DiskFullError
    from oodviz.pipeline import stages as pipeline
    from oodviz.pipeline.preflight import preflight
    from oodviz.pipeline.reporter import Reporter
    from oodviz.runs.rundir import RunDir

    config = RunConfig.from_dict(
        {"backbone": "digits-cnn", "device": "cpu", "ood": ["digits-heldout"], "detectors": ["msp"]}
    )
    (disk,) = [need for need in preflight(config, tmp_path / "runs").needs if need.resource == "disk"]
    stores = disk.needed - MARGIN_BYTES
    assert 0 < stores < MARGIN_BYTES and f" + {format_bytes(MARGIN_BYTES)} head room" in disk.what
    for free in (disk.needed - 1, disk.needed):
        monkeypatch.setattr(oodviz.engine.store.space, "free_bytes", lambda root, free=free: free)
        (need,) = [need for need in preflight(config, tmp_path / "runs").needs if need.resource == "disk"]
        assert (need.needed, need.over) == (disk.needed, free < disk.needed)
        run = RunDir.create(tmp_path / str(free), config.to_dict())
        job = pipeline.start_job(config, run, Reporter(run))
        pipeline.load_model(job)
        if free < disk.needed:
            with pytest.raises(DiskFullError, match=f"^disk full: needed ~{format_bytes(disk.needed)}, "):
                pipeline.load_data(job)
        else:
            pipeline.load_data(job)


def test_the_apps_start_refuses_a_knn_k_above_the_fit_rows_and_starts_nothing(
    tmp_path, monkeypatch, app_subprocesses_in_process
):
    """The app's Start runs the same pre-flight (the probe): 10 ID fit images with knn's default k=50 are refused
    under the form, naming the field and the fix, and nothing is submitted."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    import oodviz.ui.new_run

    submitted = []
    monkeypatch.setattr(oodviz.ui.new_run, "submit", lambda config, root, nproc_per_node=1: submitted.append(config))
    monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path / "runs"))
    app = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=120)
    app.run()
    [box for box in app.number_input if box.label == "ID fit"][0].set_value(10)
    [button for button in app.button if button.label == "Start run"][0].click().run()
    assert not app.exception
    shown = " ".join(e.value for e in app.error)
    assert "(knn): k=50 is more than the 10 rows of the ID fit set; choose k <= 10 or fit on more data" in shown
    assert submitted == [] and not (tmp_path / "runs").exists()
