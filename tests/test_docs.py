"""The documentation site: built strictly (no broken link, no unresolved reference), its generated pages true to the
code, and the README's library example run.

The build needs the docs extra (mkdocs, mkdocs-material, mkdocstrings[python]; in the test extra, so CI builds it):
without it those tests skip. The generated parts (docs/hooks/generated.py) are checked without MkDocs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from oodviz.config.run import RunConfig
from oodviz.data import available_datasets
from oodviz.detectors import available, detector_class

REPO = Path(__file__).resolve().parent.parent


def _generated():
    spec = importlib.util.spec_from_file_location("docs_generated", REPO / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]  # --strict: a broken link or reference is an error
    return out


def test_the_site_builds_strictly_and_its_detector_page_lists_every_detector(site):
    page = (site / "detectors" / "index.html").read_text()
    for name in available():
        cls = detector_class(name)
        assert f'id="{name}"' in page, name  # its section
        assert cls.paper in page, name
        assert f"{cls.__module__}.{cls.__name__}" in page, name  # the link to its class in the API reference
    api = (site / "api" / "detector-classes" / "index.html").read_text()
    for name in available():
        cls = detector_class(name)
        assert f'id="{cls.__module__}.{cls.__name__}"' in api, name


def test_the_api_reference_has_the_docstrings(site):
    first = RunConfig.__doc__.strip().split("\n")[0]
    assert first in (site / "api" / "config" / "index.html").read_text()
    assert 'id="oodviz.config.run.RunConfig"' in (site / "api" / "config" / "index.html").read_text()
    front = (site / "api" / "oodviz" / "index.html").read_text()
    assert 'id="oodviz.RunConfig"' in front and 'id="oodviz.Batch"' in front
    for page in (front, (site / "api" / "config" / "index.html").read_text()):
        assert not re.search(r":(func|mod|class|meth):(`|<code>)", page)  # Sphinx roles became references or code


def test_the_site_works_offline(site):
    """No Google fonts, no CDN: KaTeX comes from the package."""
    for page in ("index.html", "detectors/index.html"):
        html = (site / page).read_text()
        assert "fonts.googleapis.com" not in html and "cdn.jsdelivr" not in html, page
    assert (site / "katex" / "katex.min.js").is_file() and (site / "assets" / "screenshots" / "watch.png").is_file()


def test_the_cli_page_shows_every_command(site):
    page = (site / "cli" / "index.html").read_text()
    for command in _generated().CLI_COMMANDS:
        assert f"oodviz {' '.join(command)}" in page, command
    assert "--nproc-per-node" in page and "--figure-files" in page


def test_the_generated_detector_table_lists_every_detector_with_its_grid_and_paper():
    """(Was the README's hand-written table; the docs generate it from the same declarations.)"""
    table = _generated().detector_table()
    for name in available():
        cls = detector_class(name)
        [row] = [line for line in table.splitlines() if line.startswith(f"| [`{name}`](#{name}) |")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cls.paper in cells[-1], name
        for param in set(cls.param_names()) - {"model"}:  # the model is the run's
            assert re.search(rf"\b{param}=", cells[1]), (name, param)
        grid = cells[2]
        for key, values in cls.default_grid.items():
            listed = re.search(rf"`{key}`: ([^;]*)", grid)
            assert listed and listed.group(1).strip() == ", ".join(map(str, values)), (name, key, grid)
        if not cls.default_grid:
            assert grid == "—", (name, grid)


def test_the_configs_page_describes_every_field_and_dataset():
    page = (REPO / "docs" / "configs.md").read_text()
    for field in dataclasses.fields(RunConfig):
        assert re.search(rf"^\| `{field.name}` \|", page, re.M), field.name
    for name in available_datasets():
        assert f"`{name}`" in page, name
    for example in sorted((REPO / "examples").glob("*.toml")):
        assert f"examples/{example.name}" in page, example.name
        RunConfig.load(example)  # each example is a valid config


def test_the_readme_library_example_runs(tmp_path, monkeypatch):
    """The README's ten lines, as written, on the bundled digits (a small subsample, two detectors) instead of the
    Fashion-MNIST preset, so that they run anywhere in seconds."""
    import torch

    import oodviz

    readme = (REPO / "README.md").read_text()
    [code] = re.findall(r"## The library in ten lines\n\n```python\n(.*?)```", readme, re.S)
    assert 'oodviz.preset("fashion-mnist")' in code and len(code.strip().splitlines()) <= 12
    small = RunConfig(
        id_fit=oodviz.DatasetChoice("digits-train", subsample=300),
        id_test=oodviz.DatasetChoice("digits-test", subsample=100),
        ood=[oodviz.DatasetChoice("noise-uniform", {"n": 50})],
        detectors=[oodviz.DetectorChoice("msp"), oodviz.DetectorChoice("mahalanobis")],
        device="cpu",
    )
    monkeypatch.setattr(oodviz, "preset", lambda name: small)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    # the example's store_dir and x are the run's ID fit store and four of its rows, known once the run has run:
    # its lines run in two halves, the run, then the detector
    lines = code.splitlines()
    split = next(i for i, line in enumerate(lines) if line.startswith("det = "))
    exec(compile("\n".join(lines[:split]), "README", "exec"), namespace)
    store_dir = tmp_path / "runs" / ".features" / namespace["same"].meta["splits"]["id_fit"]["store"]
    namespace["store_dir"] = store_dir
    namespace["x"] = next(iter(oodviz.FeatureStore(store_dir).batches(4))).features
    exec(compile("\n".join(lines[split:]), "README", "exec"), namespace)
    scores = namespace["scores"]
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    assert {"msp", "mahalanobis"} <= set(namespace["results"].metrics["detector"])


def test_the_library_page_examples_run(tmp_path, monkeypatch):
    """The library page's Python blocks on stand-in data (random features of a random linear head, on the CPU);
    the blocks that need a finished run or a process group are run elsewhere (the README example above,
    tests/pipeline/test_distributed.py)."""
    import torch

    page = (REPO / "docs" / "library.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    own = [b for b in blocks if "create(" in b and "World" not in b]
    assert len(own) == 2, len(own)
    generator = torch.Generator().manual_seed(0)
    d, c = 640, 4  # D above the example's vim dim=512

    def chunks(n, labelled):
        out = []
        for _ in range(n):
            f = torch.randn(256, d, generator=generator).relu()
            y = torch.randint(0, c, (256,), generator=generator)
            out.append((f, f @ model.fc.weight.T + model.fc.bias, y) if labelled else (f, f @ model.fc.weight.T))
        return out

    model = torch.nn.Module()
    model.fc = torch.nn.Linear(d, c)
    monkeypatch.chdir(tmp_path)
    from oodviz import Batch

    namespace = {
        "model": model,
        "my_id_train_chunks": chunks(4, True),
        "my_id_test_chunks": [(f, z) for f, z, _ in chunks(2, True)],
        "my_ood_chunks": [(f * 3, z * 3) for f, z, _ in chunks(2, True)],
    }
    with torch.no_grad():
        exec(compile(own[0].replace('device="cuda"', 'device="cpu"'), "library.md", "exec"), namespace)
    assert torch.equal(namespace["same"].score(namespace["ood_batches"]), namespace["ood_scores"])
    halves = [Batch(features=f, labels=y) for f, _, y in chunks(4, True)]
    split = {"first_half_batches": halves[:2], "second_half_batches": halves[2:]}
    exec(compile(own[1], "library.md", "exec"), split)
    from oodviz.detectors import create

    whole = create("mahalanobis").fit(halves)  # what the page says the merged halves equal
    query = Batch(features=namespace["ood_batches"][0].features)
    torch.testing.assert_close(split["a"].score(query), whole.score(query), rtol=1e-5, atol=1e-4)
