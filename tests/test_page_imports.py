"""The results, past-runs and live pages draw without torch (issue 14.5, cold first load): torch, scikit-learn and
scipy are imported only by what needs them (starting a run, the probe tab, a detector's explanation, the curves).
Each check runs in a fresh interpreter, which is what a first page load is."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import pytest

from oodviz.runs.config import RunConfig, preset

HEAVY = ("torch", "torchvision", "sklearn", "scipy")
#: What the run page imports and reads before it draws the results (the app's sidebar aside: its detector
#: lists and parameters come from the detector classes, which are torch modules).
PAGE_MODULES = ("oodviz.ui.results", "oodviz.ui.history", "oodviz.ui.watch", "oodviz.runs.config", "oodviz.runs.plan")


def imported_after(code: str) -> list[str]:
    """The top-level packages of :data:`HEAVY` in ``sys.modules`` after ``code`` runs in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_the_result_pages_modules_import_no_torch_sklearn_or_scipy():
    assert imported_after("\n".join(f"import {name}" for name in PAGE_MODULES)) == []


@pytest.mark.parametrize("name", ["digits", "fashion-mnist"])
def test_reading_a_runs_config_and_its_headline_needs_no_torch(tmp_path, name):
    config = preset(name)
    path = tmp_path / "config.json"
    config.save(path)
    code = (
        "from oodviz.runs.config import RunConfig\nfrom oodviz.runs.plan import run_headline\n"
        f"config = RunConfig.load({str(path)!r})\nprint(run_headline(config))"
    )
    assert imported_after(code) == []
    # the same config and headline as read with everything imported
    from oodviz.runs.plan import run_headline

    loaded = RunConfig.load(path)
    assert loaded == config
    assert run_headline(loaded).startswith(f"{config.backbone} · ID {config.id_test.name}")


def test_sizes_format_without_torch_and_every_model_name_is_its_submodules():
    assert imported_after("from oodviz.models import format_bytes\nassert format_bytes(1536) == '1.5 KiB'") == []
    models = importlib.import_module("oodviz.models")
    submodules = [importlib.import_module(f"oodviz.models.{m.name}") for m in pkgutil.iter_modules(models.__path__)]
    for name in models.__all__:
        defined = [vars(module)[name] for module in submodules if name in vars(module)]
        if name == "feature_shape":  # defined in the package itself
            assert not defined
            continue
        assert defined and all(getattr(models, name) is value for value in defined), name
    with pytest.raises(AttributeError):
        models.no_such_name  # noqa: B018
