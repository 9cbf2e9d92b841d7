"""The results, past-runs and live pages draw without torch (issue 14.5, cold first load): torch, scikit-learn and
scipy are imported only by what needs them (starting a run, the probe tab, a detector's explanation, the curves).
Each check runs in a fresh interpreter, which is what a first page load is."""

from __future__ import annotations

import importlib
import json
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from oodviz.config.run import RunConfig, preset

pytestmark = pytest.mark.process  # each check runs in a fresh interpreter

HEAVY = ("torch", "torchvision", "sklearn", "scipy")
#: What the run page imports and reads before it draws the results.
PAGE_MODULES = ("oodviz.ui.results", "oodviz.ui.history", "oodviz.ui.watch", "oodviz.config.run", "oodviz.config.plan")


APP = str(Path(__file__).resolve().parents[2] / "app.py")
#: Prints the top-level packages of :data:`HEAVY` in ``sys.modules``.
REPORT = f"import sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"


def imported_after(code: str) -> list[str]:
    """The top-level packages of :data:`HEAVY` in ``sys.modules`` after ``code`` runs in a fresh interpreter."""
    probe = f"{code}\n{REPORT}"
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
        "from oodviz.config.run import RunConfig\nfrom oodviz.config.plan import run_headline\n"
        f"config = RunConfig.load({str(path)!r})\nprint(run_headline(config))"
    )
    assert imported_after(code) == []
    # the same config and headline as read with everything imported
    from oodviz.config.plan import run_headline

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


def test_a_run_page_and_the_new_run_form_import_no_torch_torchvision_sklearn_or_scipy(default_run, tmp_path):
    """The whole app script on a finished run's page, then on the New run page started from that run
    (``?from=r1``), in one fresh interpreter: the form (backbones, layers, detectors, parameters, grids, devices, the
    ID fit set's count) reads :mod:`oodviz.config.catalog`; the detector explanation of the run's page is drawn only
    once opened. Its count is the loaded set's. The results page's last step, :func:`oodviz.ui.results.prefetch`
    (background threads that open the galleries' datasets and import scikit-learn once the page is drawn), is
    recorded here instead of started."""
    from oodviz.data import load_dataset

    shutil.copytree(default_run.path, tmp_path / "r1")
    code = (
        f"import os\nos.environ['OODVIZ_RUNS_ROOT'] = {str(tmp_path)!r}\n"
        "from streamlit.testing.v1 import AppTest\nimport oodviz.ui.results as page\n"
        "prefetched = []\npage.prefetch = prefetched.append\n"
        f"app = AppTest.from_file({APP!r}, default_timeout=300)\n"
        "app.query_params['run'] = 'r1'\napp.run()\nassert not app.exception, app.exception\nassert prefetched\n"
        "assert [s.label for s in app.selectbox][:2] == ['Run', 'Detector'], app.selectbox\n"
        "app.query_params.clear()\napp.query_params['from'] = 'r1'\n"
        "app.switch_page('oodviz/ui/app_pages/new_run.py').run()\nassert not app.exception, app.exception\n"
        "print([n.label for n in app.number_input if n.label.startswith('Held-out ID images')])\n"
        "print(len([m for m in app.multiselect if m.label == 'Detectors'][0].options))"
    )
    done = subprocess.run([sys.executable, "-c", f"{code}\n{REPORT}"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    held_out, detectors, heavy = done.stdout.strip().splitlines()[-3:]
    assert json.loads(heavy.replace("'", '"')) == []
    assert held_out == str([f"Held-out ID images (of the {len(load_dataset('digits-train')):,} ID fit images)"])
    assert int(detectors) == len(importlib.import_module("oodviz.detectors").available())
