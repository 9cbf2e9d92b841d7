"""A store you can trust (issue 12.7, 12.8): checksums, damaged stores, stale writers, full disks, unused stores."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from tiny_backbone import ListDataset, TinyBackbone, assert_store_equals, reference

from oodviz.cli import main
from oodviz.engine import (
    DiskFullError,
    StoreWriter,
    check_free_space,
    clean_stale_tmp,
    extract,
    extract_or_reuse,
    open_store,
    remove_store,
    store_users,
    stores_used_only_by,
)


def blake2b(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def corrupt_middle(path: Path, keep_mtime: bool) -> None:
    """Overwrite bytes in the middle of ``path``'s data, same size; optionally restore its mtime (ns)."""
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 + 64
    data[middle : middle + 16] = bytes(255 - b for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))
    assert os.stat(path).st_size == before.st_size
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(path).st_mtime_ns == before.st_mtime_ns


# ----------------------------------------------------------------------------- checksums


def test_checksums_cover_every_byte_of_the_final_files(tmp_path):
    # Two unreadable items: the arrays are shrunk at commit, so the .npy headers are rewritten in place.
    backbone, dataset = TinyBackbone(), ListDataset(n=11, corrupt=(3, 8))
    store = extract(backbone, dataset, tmp_path, batch_size=4)
    assert store.n == 9
    records = json.loads((store.path / "meta.json").read_text())["files"]
    assert sorted(records) == sorted(
        ["features", "logits", "labels", "predictions", "indices", "head_weight", "head_bias"]
    )
    for name, record in records.items():
        raw = (store.path / f"{name}.npy").read_bytes()
        offset = record["data_offset"]
        assert raw[:6] == b"\x93NUMPY" and raw[offset - 1 : offset] == b"\n"  # the header ends where recorded
        assert record["size"] == len(raw)
        assert record["mtime_ns"] == os.stat(store.path / f"{name}.npy").st_mtime_ns
        assert record["header_blake2b"] == blake2b(raw[:offset])
        assert record["data_blake2b"] == blake2b(raw[offset:])
    assert np.load(store.path / "features.npy").shape == (9, 6)
    assert store.verify(full=True) == [] and store.verify() == []


# ----------------------------------------------------------------------------- damaged stores


@pytest.mark.parametrize("damage", ["same size, new mtime", "truncated"])
def test_reuse_detects_a_damaged_store_and_extracts_again(tmp_path, damage, caplog):
    backbone, dataset = TinyBackbone(), ListDataset(n=10)
    first = extract_or_reuse(backbone, dataset, tmp_path, {"split": "val"}, batch_size=4)
    other = extract_or_reuse(backbone, ListDataset(n=5, name="other"), tmp_path, batch_size=4)
    other_bytes = (other.path / "features.npy").read_bytes()
    features = first.path / "features.npy"
    if damage == "truncated":
        with open(features, "r+b") as f:
            f.truncate(os.stat(features).st_size - 24)
    else:
        corrupt_middle(features, keep_mtime=False)
    calls = backbone.calls

    store = extract_or_reuse(backbone, dataset, tmp_path, {"split": "val"}, batch_size=4)
    assert backbone.calls == calls + 3 and store.reused is False  # extracted again
    assert store.path == first.path
    assert_store_equals(store, *reference(backbone, dataset))
    assert store.verify(full=True) == []
    assert first.key in store.reuse_warning and "features.npy" in store.reuse_warning
    assert ("data differ" if damage != "truncated" else "bytes") in store.reuse_warning
    assert any("damaged" in r.message for r in caplog.records)
    # The other store is untouched and nothing is left aside.
    assert (other.path / "features.npy").read_bytes() == other_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.key, other.key])

    again = extract_or_reuse(backbone, dataset, tmp_path, {"split": "val"}, batch_size=4)
    assert again.reused is True and again.reuse_warning is None and backbone.calls == calls + 3


def test_same_size_same_mtime_corruption_is_caught_by_store_verify_and_full_reuse(tmp_path, capsys):
    """The failure of the issue: bytes overwritten in features.npy, size and mtime restored."""
    runs_root = tmp_path / "runs"
    store_root = runs_root / ".features"
    backbone, dataset = TinyBackbone(), ListDataset(n=10)
    first = extract_or_reuse(backbone, dataset, store_root, batch_size=4)
    intact = extract_or_reuse(backbone, ListDataset(n=5, name="other"), store_root, batch_size=4)
    assert main(["store", "verify", "--runs-root", str(runs_root)]) == 0
    capsys.readouterr()

    corrupt_middle(first.path / "features.npy", keep_mtime=True)
    # The cheap check trusts a file whose size and mtime match: that is what `store verify` is for.
    assert first.verify() == []
    assert extract_or_reuse(backbone, dataset, store_root, batch_size=4).reused is True

    assert main(["store", "verify", "--runs-root", str(runs_root)]) == 1
    out = capsys.readouterr().out
    damaged = [line for line in out.splitlines() if line.startswith("DAMAGED")]
    assert damaged == [
        f"DAMAGED  {first.key}: features.npy: its data differ from the checksum taken when it was written"
    ]
    assert f"ok       {intact.key}" in out

    # --remove takes the damaged store away (and only it); the next run extracts it again either way.
    aside = store_root.parent / "damaged-copy"
    shutil.copytree(first.path, aside, copy_function=shutil.copy2)
    assert main(["store", "verify", "--runs-root", str(runs_root), "--remove"]) == 1
    assert f"removed  {first.path}" in capsys.readouterr().out
    assert sorted(p.name for p in store_root.iterdir()) == [intact.key]
    shutil.copytree(aside, first.path, copy_function=shutil.copy2)  # back, damaged, mtimes kept

    calls = backbone.calls
    store = extract_or_reuse(backbone, dataset, store_root, batch_size=4, verify="full")
    assert backbone.calls == calls + 3 and store.reused is False
    assert first.key in store.reuse_warning and "features.npy" in store.reuse_warning
    assert_store_equals(store, *reference(backbone, dataset))
    assert main(["store", "verify", "--store-root", str(store_root)]) == 0  # the damaged store was replaced

    with pytest.raises(ValueError, match="verify must be one of"):
        extract_or_reuse(backbone, dataset, store_root, verify="none")


def test_store_without_checksums_is_extracted_again(tmp_path, capsys):
    backbone, dataset = TinyBackbone(), ListDataset(n=6)
    store = extract(backbone, dataset, tmp_path, batch_size=4)
    meta = json.loads((store.path / "meta.json").read_text())
    del meta["files"]  # what a store written before checksums looks like at this key
    (store.path / "meta.json").write_text(json.dumps(meta))
    calls = backbone.calls
    again = extract_or_reuse(backbone, dataset, tmp_path, batch_size=4)
    assert backbone.calls == calls + 2 and again.reused is False
    assert "no checksums" in again.reuse_warning
    assert "files" in json.loads((again.path / "meta.json").read_text())

    # A store of the previous format (its own key) is reported as outdated, not damaged.
    old = tmp_path / "0123456789abcdef0123"
    shutil.copytree(again.path, old)
    meta["format"] = 1
    (old / "meta.json").write_text(json.dumps(meta))
    assert main(["store", "verify", "--store-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "outdated 0123456789abcdef0123: store format 1" in out and f"ok       {again.key}" in out


# ----------------------------------------------------------------------------- stale writers


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.process
def test_stale_tmp_needs_the_owner_pid_and_its_start_time(tmp_path):
    me = os.getpid()
    started = int(psutil.Process(me).create_time() * 1000)
    writing = tmp_path / f"k1.tmp-{me}-{started}-0a1b"  # this process, right start time: alive
    reused = tmp_path / f"k2.tmp-{me}-{started - 3_600_000}-0a1b"  # same pid, started an hour earlier: not us
    dead = tmp_path / f"k3.tmp-{_dead_pid()}-{started}-0a1b"
    legacy = tmp_path / f"k4.tmp-{me}-cafe"  # no start time recorded: the pid alone decides
    aside = tmp_path / f"k5.old-{me}-{started - 3_600_000}-0a1b"
    store_like = tmp_path / "k6"
    for path in (writing, reused, dead, legacy, aside, store_like):
        path.mkdir()
        (path / "features.npy").write_bytes(b"x")
    removed = clean_stale_tmp(tmp_path, min_age_s=0)
    assert sorted(p.name for p in removed) == sorted([reused.name, dead.name, aside.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([writing.name, legacy.name, store_like.name])
    # A live owner's directory still goes once nothing in it changed for max_age_s.
    assert sorted(p.name for p in clean_stale_tmp(tmp_path, max_age_s=0)) == sorted([writing.name, legacy.name])


def test_a_writer_names_its_directory_with_pid_and_start_time(tmp_path):
    with StoreWriter(tmp_path, "k", capacity=3, feature_dim=2, num_classes=2) as writer:
        pid, start, _ = writer.tmp_path.name.split(".tmp-")[1].split("-")
        assert int(pid) == os.getpid()
        assert abs(int(start) - psutil.Process().create_time() * 1000) < 1000
        assert clean_stale_tmp(tmp_path, min_age_s=0) == [] and writer.tmp_path.exists()
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and mount); skipped elsewhere."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Write a file that leaves about ``leave`` bytes free on ``disk``."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(shutil.disk_usage(disk).free - leave, 0))
    return filler


@pytest.mark.process
def test_free_space_check_against_a_small_disk(small_disk):
    free = shutil.disk_usage(small_disk).free
    assert 900 << 10 <= free <= 1 << 20
    assert check_free_space(small_disk, 100 << 10, margin_bytes=0) is None
    message = check_free_space(small_disk, 2 << 20, margin_bytes=0)
    assert message.startswith("disk full: needed ~2 MiB, ") and f"free under {small_disk}" in message
    # The default margin (16 MiB) does not fit on a 1 MiB disk either.
    assert check_free_space(small_disk, 100 << 10).startswith("disk full: needed ~16.1 MiB")
    assert check_free_space(small_disk / "not" / "yet", 100 << 10, margin_bytes=0) is None  # nearest parent
    with pytest.raises(ValueError, match="needed_bytes"):
        check_free_space(small_disk, -1)


@pytest.mark.process
def test_writer_refuses_a_store_that_does_not_fit(small_disk):
    needed = 1000 * (1000 * 4 + 2 * 4 + 3 * 8)  # features, logits, labels + predictions + indices
    with pytest.raises(DiskFullError, match=rf"^disk full: needed ~{needed / 2**20:.3g} MiB, 1 MiB free under "):
        StoreWriter(small_disk / "stores", "k", capacity=1000, feature_dim=1000, num_classes=2)
    assert list((small_disk / "stores").iterdir()) == []


@pytest.mark.process
def test_disk_full_while_writing_removes_the_tmp_dir_and_says_so(small_disk):
    root = small_disk / "stores"
    writer = StoreWriter(root, "k", capacity=100, feature_dim=1000, num_classes=2)  # ~400 KiB: fits for now
    filler = fill(small_disk, leave=64 << 10)  # someone else takes the space
    rows = np.ones((100, 1000), np.float32)
    with pytest.raises(DiskFullError) as caught:
        writer.append(rows, np.zeros((100, 2)), np.zeros(100, np.int64), np.arange(100))
    assert caught.value.errno == errno.ENOSPC
    needed, free = 100 * (1000 * 4 + 2 * 4 + 3 * 8), shutil.disk_usage(small_disk).free  # free once the tmp dir went
    assert str(caught.value).startswith(
        f"disk full: needed ~{needed / 1024:.3g} KiB, {free / 1024:.3g} KiB free under {root};"
    )
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert list(root.iterdir()) == []  # the temporary directory is gone
    filler.unlink()


@pytest.mark.process
def test_extraction_on_a_full_disk_fails_with_the_cause_and_leaves_nothing(small_disk):
    root = small_disk / "stores"
    root.mkdir()
    fill(small_disk, leave=2 << 10)
    with pytest.raises(DiskFullError, match="disk full: needed ~"):
        extract(TinyBackbone(), ListDataset(n=10), root, batch_size=4)
    assert list(root.iterdir()) == []


def test_other_io_errors_remove_the_tmp_dir_and_keep_their_cause(tmp_path):
    writer = StoreWriter(tmp_path, "k", capacity=4, feature_dim=3, num_classes=2)

    class FailingFile:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(errno.EIO, "Input/output error")

        def __getattr__(self, name):
            return getattr(self.file, name)

    logits = writer._files["logits"]
    logits.file = FailingFile(logits.file)
    with pytest.raises(OSError) as caught:
        writer.append(np.ones((2, 3)), np.ones((2, 2)), np.zeros(2, np.int64), np.arange(2))
    assert caught.value.errno == errno.EIO and not isinstance(caught.value, DiskFullError)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- which runs use a store


def make_run(runs_root: Path, name: str, stores: list | None, state: str = "done", meta_text: str | None = None):
    run = runs_root / name
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": state}))
    if meta_text is not None:
        (run / "meta.json").write_text(meta_text)
    elif stores is not None:
        splits = {f"split{i}": {"store": key, "n": 1} for i, key in enumerate(stores)}
        (run / "meta.json").write_text(json.dumps({"splits": splits}))
    return run


def test_stores_used_only_by_a_run_and_their_removal(tmp_path, capsys):
    runs_root = tmp_path / "runs"
    store_root = runs_root / ".features"
    for key in ("aaaa", "bbbb", "cccc"):
        (store_root / key).mkdir(parents=True)
        (store_root / key / "features.npy").write_bytes(b"x")
    first = make_run(runs_root, "r1", ["aaaa", "bbbb", "gone", "../../escape"])
    make_run(runs_root, "r2", ["bbbb", "cccc"])
    make_run(runs_root, "r3", None, meta_text="[not json")  # damaged and finished: uses nothing
    make_run(runs_root, "r4", None, state="failed")  # failed before it wrote meta.json

    assert stores_used_only_by(first, runs_root) == [store_root / "aaaa"]
    assert store_users(runs_root) == {"aaaa": ["r1"], "bbbb": ["r1", "r2"], "cccc": ["r2"], "gone": ["r1"]}
    assert stores_used_only_by(runs_root / "r3", runs_root) == []

    # A queued run has not said which stores it will reuse: offer nothing.
    waiting = make_run(runs_root, "r5", None, state="queued")
    assert stores_used_only_by(first, runs_root) == []
    shutil.rmtree(waiting)

    assert remove_store(store_root, "aaaa") == store_root / "aaaa"
    assert sorted(p.name for p in store_root.iterdir()) == ["bbbb", "cccc"]
    with pytest.raises(FileNotFoundError, match="no feature store 'aaaa'"):
        remove_store(store_root, "aaaa")
    with pytest.raises(ValueError, match="plain directory name"):
        remove_store(store_root, "../r1")
    assert stores_used_only_by(first, runs_root) == []  # its only own store is gone


def test_store_list_names_sizes_and_users(tmp_path, capsys):
    runs_root = tmp_path / "runs"
    store = extract(TinyBackbone(), ListDataset(n=7), runs_root / ".features", batch_size=4)
    make_run(runs_root, "r1", [store.key])
    make_run(runs_root, "r2", [store.key])
    assert main(["store", "list", "--runs-root", str(runs_root)]) == 0
    size = sum(p.stat().st_size for p in store.path.iterdir())
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{store.key}  tiny on toy: 7 x 6 float32, ") and line.endswith("used by 2 run(s)")
    assert f"{size / 1024:.3g} KiB" in line
    assert open_store(runs_root / ".features", store.key).verify(full=True) == []
