"""`oodviz run BAD`: one message listing every problem, exit code 2, no traceback, no run directory."""

import json
import os
import subprocess
import sys

import pytest
import torch

from oodviz.cli import main

SMALL = {
    "backbone": "digits-cnn",
    "device": "cpu",
    "ood": ["digits-heldout"],
    "detectors": ["msp"],
}


def small(**changes) -> dict:
    return {**SMALL, **changes}


def write(tmp_path, name: str, content) -> str:
    """``content``: a dict (written as JSON), str (UTF-8 text) or bytes."""
    path = tmp_path / name
    if isinstance(content, dict):
        content = json.dumps(content)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def refused(tmp_path, capsys, config_path: str) -> str:
    """Run ``oodviz run CONFIG`` in-process; assert exit 2 and no run directory; return stderr."""
    runs_root = tmp_path / "runs"
    code = main(["run", config_path, "--runs-root", str(runs_root)])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert not runs_root.exists(), list(runs_root.iterdir())
    assert "Traceback" not in err + out
    assert err.startswith("Invalid run config:\n- "), err
    return err


NO_GPU_HERE = "CUDA is not available" if not torch.cuda.is_available() else "GPU"

CASES = {
    "batch_size true": (small(batch_size=True), ["batch_size must be an integer, got true"]),
    "device cuda:9": (small(device="cuda:9"), ["device='cuda:9'", NO_GPU_HERE]),
    "unknown dataset param": (
        small(ood=[{"name": "noise-gaussian", "params": {"colour": 1}}]),
        ["ood[0] (noise-gaussian) has no parameter(s) colour; its parameters: n, size, channels, noise_seed"],
    ),
    "negative n": (small(ood=[{"name": "noise-gaussian", "params": {"n": -5}}]), ["n must be positive, got -5"]),
    "unknown layer": (
        small(backbone="resnet18", weights="random", layer="layer9"),
        ["resnet18 has no layer 'layer9'", "'layer4'", "Its top-level layers: conv1, bn1, relu, maxpool"],
    ),
    "k Infinity": (
        '{"ood": ["digits-heldout"], "device": "cpu", "detectors": [{"name": "knn", "params": {"k": Infinity}}]}',
        ["detectors[0] (knn): k must be a finite number, got Infinity"],
    ),
    "NaN budget": ('{"memory_budget_gb": NaN}', ["memory_budget_gb must be a finite number, got NaN"]),
    "null values": (
        small(backbone=None, batch_size=None, ood=[{"name": "digits-heldout", "subsample_mode": None}]),
        [
            "backbone needs a value (a string), got null",
            "batch_size needs a value (an integer), got null",
            "ood[0].subsample_mode needs a value (a string), got null",
        ],
    ),
    "top-level list": ('[{"backbone": "digits-cnn"}]', ["must hold a table of settings", "got a list"]),
    "a string where a list goes": (
        small(ood="digits-heldout"),
        ['ood must be a list of names or tables, got "digits-heldout"'],
    ),
    "params that are a list": (
        small(detectors=[{"name": "knn", "params": [5]}]),
        ["detectors[0].params must be a table, got [5]"],
    ),
    "latin-1 bytes": (
        '{"data_root": "donn\u00e9es"}'.encode("latin-1"),
        ["is not UTF-8 text (byte 0xe9 at offset 19); save it as UTF-8"],  # offset = len('{"data_root": "donn'),
    ),
    "1000-deep nesting": (
        '{"ood": ' + "[" * 1000 + "]" * 1000 + "}",
        ["nests tables or lists more than 32 levels deep"],
    ),
    "40-deep nesting": ('{"ood": ' + "[" * 40 + "]" * 40 + "}", ["nests tables or lists more than 32 levels deep"]),
    "download no": (small(download="no"), ['download must be true or false, got "no"']),
    "batch_size above the limit": (small(batch_size=100_000), ["batch_size must be at most 65536", "got 100000"]),
    "num_workers above the cores": (
        small(num_workers=10_000),
        ["num_workers must be at most", "(the CPU cores this process may use), got 10000"],
    ),
    "invalid JSON": ('{"batch_size": 3,}', ["is not valid JSON"]),
    "an integer of 5000 digits": ('{"batch_size": 1' + "0" * 5000 + "}", ["is not valid JSON", "Exceeds the limit"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_config_is_refused_with_one_message_before_any_work(tmp_path, capsys, case):
    content, expected = CASES[case]
    err = refused(tmp_path, capsys, write(tmp_path, "bad.json", content))
    for text in expected:
        assert text in err, err


def test_every_problem_is_listed_at_once(tmp_path, capsys):
    config = small(
        batch_size=True,
        device="cuda:9",
        download="no",
        ood=[{"name": "noise-gaussian", "params": {"n": -5, "colour": 1}}],
        detectors=[{"name": "knn", "params": {"k": 0}}, "nope"],
    )
    err = refused(tmp_path, capsys, write(tmp_path, "bad.json", config))
    problems = [line for line in err.splitlines() if line.startswith("- ")]
    assert len(problems) == 7, err
    for text in (
        "batch_size",
        "cuda:9",
        "download",
        "colour",
        "n must be positive",
        "knn: k must be a positive integer, got 0",
        "'nope'",
    ):
        assert text in err, (text, err)


@pytest.mark.parametrize(
    "encoding, bom", [("utf-16-le", b"\xff\xfe"), ("utf-16-be", b"\xfe\xff"), ("utf-32-le", b"\xff\xfe\x00\x00")]
)
def test_a_config_in_utf16_or_utf32_with_a_byte_order_mark_is_read(tmp_path, capsys, encoding, bom):
    # batch_size 0 makes the run stop at validation: the message shows the file was decoded and parsed
    text = json.dumps(small(batch_size=0, data_root="donn\u00e9es"))
    err = refused(tmp_path, capsys, write(tmp_path, "cfg.json", bom + text.encode(encoding)))
    assert err == "Invalid run config:\n- batch_size must be an integer >= 1, got 0\n"


def test_a_missing_file_a_directory_and_an_unreadable_file_get_one_message_each(tmp_path, capsys):
    assert refused(tmp_path, capsys, str(tmp_path / "nope.json")) == (
        f"Invalid run config:\n- config file {tmp_path / 'nope.json'} does not exist\n"
    )
    folder = tmp_path / "folder.json"
    folder.mkdir()
    err = refused(tmp_path, capsys, str(folder))
    assert f"{folder} is a directory; give the path of a .json or .toml config file" in err
    if os.geteuid() != 0:  # root reads any file
        locked = write(tmp_path, "locked.json", small())
        os.chmod(locked, 0)
        assert f"cannot read config file {locked}: Permission denied" in refused(tmp_path, capsys, locked)


def test_a_toml_config_with_inf_and_deep_dotted_keys_is_refused(tmp_path, capsys):
    err = refused(
        tmp_path, capsys, write(tmp_path, "bad.toml", 'memory_budget_gb = inf\nseed = -1\nbatch_size = "8"\n')
    )
    assert "memory_budget_gb must be a finite number, got Infinity" in err
    assert "seed must be an integer >= 0, got -1" in err
    assert 'batch_size must be an integer, got "8"' in err
    deep = 'ood = [{name = "noise-gaussian", params = {' + ".".join(["a"] * 40) + " = 1}}]\n"
    assert "more than 32 levels deep" in refused(tmp_path, capsys, write(tmp_path, "deep.toml", deep))


@pytest.mark.process
def test_the_command_line_prints_the_message_without_a_traceback_and_exits_2(tmp_path):
    config = write(tmp_path, "bad.json", b'{"batch_size": true, "device": "cuda:9"}' + b"\xff")
    result = subprocess.run(
        [sys.executable, "-m", "oodviz.cli", "run", config, "--runs-root", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"Invalid run config:\n- {config} is not UTF-8 text (byte 0xff at offset 40); save it as UTF-8 "
        "(UTF-16 and UTF-32 are read when the file starts with a byte-order mark)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_before_the_run_directory_exists_ends_130_with_one_line_and_nothing_created(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C during the pre-flight (loading the model, the batch probe): no traceback, exit 130, no run directory."""
    import oodviz.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(oodviz.cli, "preflight_report", interrupted)
    code = oodviz.cli.main(["run", "--runs-root", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines()[-1] == "oodviz run: interrupted (Ctrl-C) before it finished"
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
