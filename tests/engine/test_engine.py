"""Extraction engine and feature store (oodviz.engine), on small self-made backbones and datasets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from kernels import assert_kernel_close
from tiny_backbone import ListDataset, TinyBackbone, TinyCNN, assert_store_equals, reference, to_tensor

from oodviz import Batch
from oodviz.detectors import create
from oodviz.engine import (
    Cancelled,
    StoreError,
    StoreWriter,
    clean_stale_tmp,
    extract,
    extract_or_reuse,
    find_store,
    list_stores,
    open_store,
    store_key,
)

pytestmark = pytest.mark.kernels  # stores against in-memory forward passes at other batch sizes, read back bit for bit
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ----------------------------------------------------------------------------- small stand-ins


# ----------------------------------------------------------------------------- round trip


def test_store_round_trip_equals_in_memory_forward(tmp_path):
    backbone, dataset = TinyBackbone(), ListDataset(n=10)
    seen = []
    store = extract(backbone, dataset, tmp_path, {"split": "val"}, batch_size=4, progress=lambda *a: seen.append(a))

    features, logits, labels, indices = reference(backbone, dataset)
    assert (store.n, store.feature_dim, store.num_classes) == (10, 6, 3)
    assert store.features.dtype == np.float32 and store.labels.dtype == np.int64
    assert_store_equals(store, features, logits, labels, indices)
    assert backbone.batch_sizes == [4, 4, 2]

    # The layout on disk and meta.json.
    assert store.path == tmp_path / store.key
    assert store.key == store_key(backbone, dataset, {"split": "val"})
    names = sorted(p.name for p in store.path.iterdir())
    assert names == sorted(
        [
            "features.npy",
            "logits.npy",
            "labels.npy",
            "predictions.npy",
            "indices.npy",
            "meta.json",
            "head_weight.npy",
            "head_bias.npy",
        ]
    )
    meta = json.loads((store.path / "meta.json").read_text())
    assert meta["complete"] is True and meta["n"] == 10 and meta["skipped"] == 0
    assert meta["counts"] == {
        "requested": 10,
        "written": 10,
        "skipped": 0,
        "nonfinite_rows": 0,
        "nonfinite_feature_rows": 0,
        "nonfinite_logit_rows": 0,
    }
    assert meta["backbone"]["name"] == "tiny" and meta["backbone"]["weights_id"] == "tiny-seed0"
    assert meta["dataset"]["name"] == "toy" and meta["params"] == {"split": "val"}
    assert meta["batch_size_in_force"] == 4 and meta["device"] == "cpu" and meta["feature_dtype"] == "float32"
    assert meta["oodviz_version"] and meta["created"] and meta["timings"]["extract_s"] > 0

    # The head is stored and reopening gives the same store.
    weight, bias = store.head
    torch.testing.assert_close(weight, backbone.model.fc.weight.detach())
    torch.testing.assert_close(bias, backbone.model.fc.bias.detach())
    again = open_store(tmp_path, store.key)
    np.testing.assert_array_equal(again.features, store.features)

    # One progress call per batch, then "done"; done counts up to the total.
    assert [s[0] for s in seen] == [4, 8, 10, 10] and all(s[1] == 10 for s in seen)
    assert seen[0][2]["batch_size"] == 4 and seen[0][2]["device"] == "cpu" and seen[0][2]["items_per_s"] > 0
    assert seen[-1][2]["stage"] == "done" and seen[-1][2]["written"] == 10


def test_float16_features_are_a_different_store(tmp_path):
    backbone, dataset = TinyBackbone(), ListDataset(n=6)
    full = extract(backbone, dataset, tmp_path, batch_size=4)
    half = extract(backbone, dataset, tmp_path, batch_size=4, feature_dtype="float16")
    assert half.key != full.key
    assert half.features.dtype == np.float16 and half.logits.dtype == np.float32
    np.testing.assert_allclose(half.features.astype(np.float32), full.features, rtol=1e-3, atol=1e-3)
    batch = next(iter(half.batches(batch_size=4)))
    assert batch.features.dtype == torch.float32 and batch.features.shape == (4, 6)


def test_key_is_canonical_and_covers_what_changes_content():
    backbone, dataset = TinyBackbone(), ListDataset(n=4)
    a = store_key(backbone, dataset, {"layer": None, "pooling": "avg", "subsample": 4, "seed": 0})
    b = store_key(backbone, dataset, {"seed": 0, "subsample": 4, "pooling": "avg", "layer": None})
    assert a == b and len(a) == 20 and all(c in "0123456789abcdef" for c in a)
    assert store_key(backbone, dataset, {"layer": None, "pooling": "avg", "subsample": 4, "seed": 1}) != a
    assert (
        store_key(backbone, dataset, {"layer": None, "pooling": "avg", "subsample": 4, "seed": 0}, precision="bf16")
        != a
    )
    other = TinyBackbone()
    other.weights_id = "tiny-seed1"
    assert store_key(other, dataset, {"layer": None, "pooling": "avg", "subsample": 4, "seed": 0}) != a
    assert (
        store_key(
            backbone, ListDataset(n=4, name="other"), {"layer": None, "pooling": "avg", "subsample": 4, "seed": 0}
        )
        != a
    )
    # Datasets that know which source items they hold (subsampling) are keyed by them too.
    subsampled = ListDataset(n=4)
    subsampled.source_indices = np.array([0, 1, 2, 3])
    first = store_key(backbone, subsampled)
    subsampled.source_indices = np.array([0, 1, 2, 5])
    assert store_key(backbone, subsampled) != first and first != store_key(backbone, dataset)
    with pytest.raises(ValueError, match="no canonical form"):
        store_key(backbone, dataset, {"transform": object()})


# ----------------------------------------------------------------------------- reuse


def test_second_call_with_same_key_reuses_without_forward(tmp_path):
    backbone, dataset = TinyBackbone(), ListDataset(n=7)
    first = extract_or_reuse(backbone, dataset, tmp_path, {"split": "train"}, batch_size=3)
    calls = backbone.calls
    assert calls == 3 and first.reused is False

    seen = []
    second = extract_or_reuse(
        backbone, dataset, tmp_path, {"split": "train"}, batch_size=3, progress=lambda *a: seen.append(a)
    )
    assert backbone.calls == calls  # no forward pass
    assert second.reused is True and second.path == first.path
    np.testing.assert_array_equal(second.features, first.features)
    assert len(seen) == 1 and seen[0][:2] == (7, 7) and seen[0][2]["stage"] == "reused"

    third = extract_or_reuse(backbone, dataset, tmp_path, {"split": "test"}, batch_size=3)
    assert backbone.calls == calls + 3 and third.key != first.key
    assert sorted(s.key for s in list_stores(tmp_path)) == sorted([first.key, third.key])


# ----------------------------------------------------------------------------- nothing untrusted


def test_failure_midway_leaves_no_store_and_no_tmp(tmp_path):
    backbone = TinyBackbone()
    dataset = ListDataset(n=10, fail_at=7)
    with pytest.raises(RuntimeError, match="disk error at item 7"):
        extract(backbone, dataset, tmp_path, batch_size=2)
    assert backbone.calls == 3  # rows were being written when it failed
    assert list(tmp_path.iterdir()) == []
    key = store_key(backbone, dataset)
    assert find_store(tmp_path, key) is None
    with pytest.raises(StoreError, match="extract it first"):
        open_store(tmp_path, key)


def test_cancel_raises_and_stores_nothing(tmp_path):
    backbone, dataset = TinyBackbone(), ListDataset(n=10)
    asked = []

    def should_cancel():
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(Cancelled, match="after 4 of 10 items"):
        extract(backbone, dataset, tmp_path, batch_size=2, should_cancel=should_cancel)
    assert len(asked) == 3 and backbone.calls == 2
    assert list(tmp_path.iterdir()) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.process
def test_leftover_tmp_dir_is_never_opened_and_is_cleaned(tmp_path):
    backbone, dataset = TinyBackbone(), ListDataset(n=5)
    good = extract(backbone, dataset, tmp_path, batch_size=8)
    key = good.key
    # A killed writer's directory: complete-looking contents under a temporary name.
    leftover = tmp_path / f"{key}.tmp-{_dead_pid()}-deadbeef"
    good.path.rename(leftover)
    assert find_store(tmp_path, key) is None
    with pytest.raises(StoreError, match="unfinished"):
        open_store(tmp_path, leftover.name)
    assert list_stores(tmp_path) == []

    calls = backbone.calls
    old = time.time() - 3600
    os.utime(leftover, (old, old))
    for p in leftover.iterdir():
        os.utime(p, (old, old))
    store = extract_or_reuse(backbone, dataset, tmp_path, batch_size=8)
    assert backbone.calls == calls + 1 and store.reused is False  # extracted again, not reused
    assert not leftover.exists()  # cleaned as stale on the way
    assert sorted(p.name for p in tmp_path.iterdir()) == [key]

    # A fresh tmp dir of a live process (this one, another writer) is left alone.
    live = tmp_path / f"{key}.tmp-{os.getpid()}-cafe"
    live.mkdir()
    assert clean_stale_tmp(tmp_path) == [] and live.exists()
    # ... until it has been untouched for max_age_s.
    assert clean_stale_tmp(tmp_path, max_age_s=0) == [live] and not live.exists()


KILLED_WRITER = """
import sys, time, pathlib
import numpy as np, torch
from oodviz.engine import extract

root, marker = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])

class Backbone:
    name, weights_id, head = "killed", "w0", None
    model = torch.nn.Linear(4, 3)
    def transform(self, image):
        return torch.as_tensor(image)
    def features_and_logits(self, x):
        return x, self.model(x)

class Slow:
    name, classes = "slow", ["a", "b", "c"]
    def __len__(self):
        return 10
    def __getitem__(self, i):
        if i == 6:
            marker.write_text("three batches went through")
            time.sleep(60)
        return np.full(4, i, np.float32), i % 3, i

extract(Backbone(), Slow(), root, batch_size=2)
"""


@pytest.mark.process
def test_killed_extraction_leaves_only_an_ignored_tmp_dir(tmp_path):
    root, marker = tmp_path / "stores", tmp_path / "marker"
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(marker)], env=env)
    try:
        deadline = time.time() + 60
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the writer process did not get going"
    finally:
        proc.kill()  # SIGKILL: no finally blocks, no clean-up
        proc.wait()
    left = list(root.iterdir())
    assert len(left) == 1 and f".tmp-{proc.pid}-" in left[0].name
    key = left[0].name.split(".tmp-")[0]
    assert np.load(left[0] / "features.npy", mmap_mode="r").shape == (10, 4)  # preallocated, partly written
    assert not (left[0] / "meta.json").exists()
    assert find_store(root, key) is None and list_stores(root) == []
    with pytest.raises(StoreError):
        open_store(root, left[0].name)
    assert clean_stale_tmp(root, min_age_s=0) == [left[0]]  # its process is gone
    assert list(root.iterdir()) == []


def test_directory_without_meta_is_replaced_not_trusted(tmp_path):
    backbone, dataset = TinyBackbone(), ListDataset(n=5)
    key = store_key(backbone, dataset)
    broken = tmp_path / key
    broken.mkdir()
    np.save(broken / "features.npy", np.zeros((5, 6), np.float32))
    assert find_store(tmp_path, key) is None
    with pytest.raises(StoreError, match="no meta.json"):
        open_store(tmp_path, key)
    store = extract_or_reuse(backbone, dataset, tmp_path, batch_size=8)
    assert backbone.calls == 1 and store.path == broken
    assert_store_equals(store, *reference(backbone, dataset))
    assert sorted(p.name for p in tmp_path.iterdir()) == [key]


# ----------------------------------------------------------------------------- OOM back-off


@pytest.mark.parametrize("message", [None, "CUDA error: out of memory (allocating 2 GiB)"])
def test_oom_backoff_gives_the_same_store_as_a_smaller_batch(tmp_path, message):
    dataset = ListDataset(n=11)
    plain = TinyBackbone(model=TinyCNN())
    at_three = extract(plain, dataset, tmp_path / "a", batch_size=3)
    assert set(plain.batch_sizes) == {3, 2}

    flaky = TinyBackbone(model=TinyCNN(), oom_above=3, oom_message=message)
    seen = []
    store = extract(flaky, dataset, tmp_path / "b", batch_size=8, progress=lambda *a: seen.append(a))
    # 8 fails, 4 fails, then the same samples go through in 2s; the second loader batch (3 items) too.
    assert flaky.batch_sizes[:3] == [8, 4, 2] and max(s for s in flaky.batch_sizes if s <= 3) == 2
    assert store.meta["batch_size_in_force"] == 2 and store.meta["batch_size_requested"] == 8
    assert store.meta["oom_backoffs"] == 2
    assert seen[0][2]["batch_size"] == 2 and seen[0][2]["oom_backoffs"] == 2
    for name in ("labels", "predictions", "indices"):
        np.testing.assert_array_equal(getattr(store, name), getattr(at_three, name))
    for name in ("features", "logits"):  # batches of 2 against batches of 3: other kernels
        assert_kernel_close(getattr(store, name), getattr(at_three, name), err_msg=name)


def test_oom_at_batch_size_one_gives_up_clearly(tmp_path):
    backbone = TinyBackbone(oom_above=0)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="even at batch size 1"):
        extract(backbone, ListDataset(n=4), tmp_path, batch_size=4)
    assert backbone.batch_sizes == [4, 2, 1]
    assert list(tmp_path.iterdir()) == []


def test_other_errors_are_not_retried(tmp_path):
    backbone = TinyBackbone(oom_above=1, oom_message="mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        extract(backbone, ListDataset(n=4), tmp_path, batch_size=4)
    assert backbone.batch_sizes == [4]


class PoisonedBackbone(TinyBackbone):
    """TinyBackbone whose features are NaN in the rows of source items ``bad_features`` and whose logits are
    infinite in the rows of ``bad_logits`` (row = position in the dataset: every item is readable)."""

    def __init__(self, bad_features=(), bad_logits=()):
        super().__init__()
        self.bad_features, self.bad_logits = set(bad_features), set(bad_logits)
        self.offset = 0

    def features_and_logits(self, x):
        features, logits = super().features_and_logits(x)
        rows = range(self.offset, self.offset + len(x))
        self.offset += len(x)
        features = features.clone()
        logits = logits.clone()
        features[[i - rows.start for i in rows if i in self.bad_features]] = float("nan")
        logits[[i - rows.start for i in rows if i in self.bad_logits], 1] = float("inf")
        return features, logits


@pytest.mark.parametrize(
    ("bad_features", "bad_logits", "counts"),
    [
        ((), (2, 9), (2, 0, 2)),  # logits only: counted too (the features are fine)
        ((1, 5), (), (2, 2, 0)),
        ((1, 5), (5, 6), (3, 2, 2)),  # row 5 is bad in both: one row
    ],
)
def test_rows_with_non_finite_features_or_logits_are_counted(tmp_path, bad_features, bad_logits, counts):
    backbone = PoisonedBackbone(bad_features, bad_logits)
    store = extract(backbone, ListDataset(n=10), tmp_path, batch_size=4)
    logits = np.asarray(store.logits)
    features = np.asarray(store.features)
    either = ~np.isfinite(features).all(axis=1) | ~np.isfinite(logits).all(axis=1)
    assert np.flatnonzero(either).tolist() == sorted(set(bad_features) | set(bad_logits))
    meta = store.meta["counts"]
    assert (meta["nonfinite_rows"], meta["nonfinite_feature_rows"], meta["nonfinite_logit_rows"]) == counts


def test_a_sticky_cuda_error_is_not_retried_and_says_to_restart(tmp_path):
    from oodviz.engine import CudaContextLost

    message = "CUDA error: an illegal memory access was encountered"
    backbone = TinyBackbone(oom_above=1, oom_message=message)
    with pytest.raises(CudaContextLost, match="unusable while extracting tiny features.*Restart the run"):
        extract(backbone, ListDataset(n=4), tmp_path, batch_size=4)
    assert backbone.batch_sizes == [4]  # no smaller retry
    assert backbone.model.conv.weight.device.type == "cpu" and list(tmp_path.iterdir()) == []


def test_a_sticky_cuda_error_after_submit_says_to_restart_too():
    """Asynchronous errors surface at the next sync, e.g. when the caller collects a result."""
    from types import SimpleNamespace

    from oodviz.engine import BatchedPass, CudaContextLost

    def collect(result):
        raise RuntimeError("CUDA error: device-side assert triggered")

    run = BatchedPass(
        SimpleNamespace(model=None, transform=to_tensor),
        ListDataset(n=4),
        device=torch.device("cpu"),
        batch_size=2,
        num_workers=0,
        precision="fp32",
        activity="scoring with odin",
        stage="score",
    )
    with pytest.raises(CudaContextLost, match="unusable while scoring with odin") as raised, run:
        run.run(lambda x, labels, indices: len(x), collect)
    assert "device-side assert" in str(raised.value.__cause__)


# ----------------------------------------------------------------------------- device hygiene


def test_model_mode_restored_and_eval_during_extraction(tmp_path):
    model = TinyCNN()
    model.train()
    model.bn.eval()  # a mixed state (frozen BN) must come back exactly
    weight = model.conv.weight
    backbone = TinyBackbone(model=model)
    store = extract(backbone, ListDataset(n=5), tmp_path, batch_size=2, channels_last=True)
    assert model.seen_training == [False, False, False]
    assert model.training is True and model.bn.training is False and model.conv.training is True
    assert model.conv.weight is weight and weight.is_contiguous()  # channels-last undone
    assert store.meta["channels_last"] is True
    assert_store_equals(store, *reference(backbone, ListDataset(n=5)))


def test_model_mode_restored_when_extraction_fails(tmp_path):
    model = TinyCNN()
    model.train()
    backbone = TinyBackbone(model=model)
    with pytest.raises(RuntimeError, match="disk error"):
        extract(backbone, ListDataset(n=6, fail_at=3), tmp_path, batch_size=2, channels_last=True)
    assert model.seen_training == [False]
    assert all(m.training for m in model.modules())
    assert model.conv.weight.device.type == "cpu" and model.conv.weight.is_contiguous()


def test_plain_callable_model_works(tmp_path):
    torch.manual_seed(1)
    projection = torch.randn(3, 5)

    def function(x):  # a function, not an nn.Module: nothing to move or put in eval mode
        features = x.mean(dim=(2, 3)) @ projection  # [B, 5]
        return features, features[:, :4] * 2.0

    class FunctionBackbone:
        name, weights_id = "function", "fixed"
        model = staticmethod(function)
        head = None

        def transform(self, image):
            return to_tensor(image)

        def features_and_logits(self, x):
            return self.model(x)

    dataset = ListDataset(n=5)
    store = extract(FunctionBackbone(), dataset, tmp_path, batch_size=2)
    x = torch.stack([to_tensor(im) for im in dataset.images])
    features, logits = function(x)
    assert (store.feature_dim, store.num_classes) == (5, 4) and store.head is None
    assert_kernel_close(store.features, features.numpy())  # batches of 2 against one of 5
    assert_kernel_close(store.logits, logits.numpy())
    assert store.meta["backbone"]["model_type"] == "function"


# ----------------------------------------------------------------------------- corrupt items


def test_corrupt_items_are_skipped_and_counted(tmp_path):
    # Items 2 and 3 form a whole batch of corrupt images at batch size 2.
    dataset = ListDataset(n=10, corrupt={0, 2, 3, 9})
    backbone = TinyBackbone()
    seen = []
    store = extract(backbone, dataset, tmp_path, batch_size=2, progress=lambda *a: seen.append(a))
    assert store.n == 6 and store.meta["skipped"] == 4
    assert store.meta["counts"] == {
        "requested": 10,
        "written": 6,
        "skipped": 4,
        "nonfinite_rows": 0,
        "nonfinite_feature_rows": 0,
        "nonfinite_logit_rows": 0,
    }
    np.testing.assert_array_equal(store.indices, [101, 104, 105, 106, 107, 108])
    assert_store_equals(store, *reference(backbone, dataset))
    assert [s[0] for s in seen] == [2, 4, 6, 8, 10, 10] and seen[-1][2]["skipped"] == 4
    # The arrays were shrunk on disk to the rows written.
    header_end = np.load(store.path / "labels.npy", mmap_mode="r").offset
    assert (store.path / "labels.npy").stat().st_size == header_end + 6 * 8
    np.testing.assert_array_equal(np.load(store.path / "labels.npy"), store.labels)


def test_all_items_corrupt_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no readable items"):
        extract(TinyBackbone(), ListDataset(n=3, corrupt={0, 1, 2}), tmp_path, batch_size=2)
    assert list(tmp_path.iterdir()) == []


def test_dataloader_workers_give_the_same_store(tmp_path):
    backbone, dataset = TinyBackbone(), ListDataset(n=9, corrupt={4})
    store = extract(backbone, dataset, tmp_path, batch_size=2, num_workers=2)
    assert store.n == 8 and store.meta["num_workers"] == 2
    assert_store_equals(store, *reference(backbone, dataset))


def test_bad_options_name_the_fix(tmp_path):
    backbone, dataset = TinyBackbone(), ListDataset(n=3)
    with pytest.raises(ValueError, match="precision must be one of"):
        extract(backbone, dataset, tmp_path, precision="fp8")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        extract(backbone, dataset, tmp_path, batch_size=0)
    with pytest.raises(ValueError, match="feature_dtype"):
        extract(backbone, dataset, tmp_path, feature_dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            extract(backbone, dataset, tmp_path, device="cuda")

    class Unpooled(TinyBackbone):
        def features_and_logits(self, x):
            return self.model.conv(x), self.model(x)

    with pytest.raises(ValueError, match=r"pool feature maps"):
        extract(Unpooled(), dataset, tmp_path)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- reading


def test_batches_are_reiterable_writable_copies(tmp_path):
    store = extract(TinyBackbone(), ListDataset(n=10), tmp_path, batch_size=4)
    for prefetch in (0, 2):
        batches = store.batches(batch_size=3, prefetch=prefetch)
        assert len(batches) == 4 and batches.n == 10
        first, second = list(batches), list(batches)
        assert [len(b) for b in first] == [3, 3, 3, 1]
        for a, b in zip(first, second):
            assert torch.equal(a.features, b.features) and torch.equal(a.logits, b.logits)
            assert torch.equal(a.labels, b.labels)
        features = torch.cat([b.features for b in first])
        np.testing.assert_array_equal(features.numpy(), store.features)
        first[0].features.zero_()  # writable, and the store is untouched
        assert np.abs(store.features[:3]).sum() > 0
    only_logits = next(iter(store.batches(include=("logits",))))
    assert only_logits.features is None and only_logits.labels is None and only_logits.logits.shape == (10, 3)
    with pytest.raises(ValueError, match="predictions and indices"):
        store.batches(include=("predictions",))


def test_store_streams_take_the_device_names_of_a_run(tmp_path):
    store = extract(TinyBackbone(), ListDataset(n=5), tmp_path, batch_size=4)
    on_cpu = list(store.batches(batch_size=2, device="cpu"))
    assert [len(b) for b in on_cpu] == [2, 2, 1] and all(b.features.device.type == "cpu" for b in on_cpu)
    np.testing.assert_array_equal(torch.cat([b.features for b in on_cpu]).numpy(), store.features)
    gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    assert store.batches(device="auto").device == (gpu or torch.device("cpu"))
    for refuse in (lambda: store.batches(device="gpu"), lambda: store.to_device("gpu")):
        with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
            refuse()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available here"):
            store.to_device("cuda")


def test_early_break_stops_the_reader_thread(tmp_path):
    store = extract(TinyBackbone(), ListDataset(n=10), tmp_path, batch_size=4)
    before = threading.active_count()
    for batch in store.batches(batch_size=1, prefetch=2):
        assert len(batch) == 1
        break
    deadline = time.time() + 5
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_detectors_fit_on_the_store_as_on_memory(tmp_path):
    dataset = ListDataset(n=30, seed=3)
    backbone = TinyBackbone()
    store = extract(backbone, dataset, tmp_path, batch_size=8)
    features, logits, labels, _ = reference(backbone, dataset)
    memory = Batch(torch.from_numpy(features), torch.from_numpy(logits), torch.from_numpy(labels))

    from_store = create("mahalanobis").fit(store.batches(batch_size=7))
    in_memory = create("mahalanobis").fit(memory)
    torch.testing.assert_close(
        from_store.score(store.batches(batch_size=5)), in_memory.score(memory), rtol=1e-4, atol=1e-4
    )

    # Two-pass ViM, with the head read back from the store.
    vim_store = create("vim", dim=3).fit(store.batches(batch_size=7), head=store.head)
    vim_memory = create("vim", dim=3).fit([memory], head=backbone.head)
    torch.testing.assert_close(vim_store.score(store.batches()), vim_memory.score(memory), rtol=1e-4, atol=1e-4)


def test_knn_searches_the_store_itself_without_a_copy(tmp_path):
    """DESIGN principle 2: knn keeps its bank in the store on disk. Store batches declare their
    features file; knn searches it (normalising as it reads) and writes nothing; the scores equal
    those of a bank written from in-memory batches. A split with OOD rows is copied without them."""
    rng = np.random.default_rng(1)
    features = rng.standard_normal((40, 5)).astype(np.float32)
    logits = rng.standard_normal((40, 3)).astype(np.float32)
    labels = np.arange(40) % 3
    with StoreWriter(tmp_path, "knn-split", capacity=40, feature_dim=5, num_classes=3) as writer:
        writer.append(features, logits, labels, np.arange(40))
        store = writer.commit({})
    banks = tmp_path / "banks"
    from_store = create("knn", k=4, bank_dir=str(banks)).fit(store.batches(batch_size=16))
    assert from_store.bank_path_ == str(store.path / "features.npy") and not banks.exists()
    in_memory = create("knn", k=4).fit([Batch(torch.from_numpy(features), labels=torch.from_numpy(labels))])
    query = [Batch(torch.from_numpy(rng.standard_normal((25, 5)).astype(np.float32)))]
    torch.testing.assert_close(from_store.score(query), in_memory.score(query))

    with_ood = labels.copy()
    with_ood[::4] = -1  # a split with OOD rows: they must not be neighbours
    with StoreWriter(tmp_path, "knn-mixed", capacity=40, feature_dim=5, num_classes=3) as writer:
        writer.append(features, logits, with_ood, np.arange(40))
        mixed = writer.commit({})
    copied = create("knn", k=4, bank_dir=str(banks)).fit(mixed.batches(batch_size=16))
    assert copied.bank_.shape == (30, 5) and copied.bank_path_.startswith(str(banks))
    keep = with_ood != -1
    id_only = create("knn", k=4).fit([Batch(torch.from_numpy(features[keep]), labels=torch.from_numpy(labels[keep]))])
    torch.testing.assert_close(copied.score(query), id_only.score(query))


def test_store_writer_commit_and_abort(tmp_path):
    rng = np.random.default_rng(0)
    with StoreWriter(tmp_path, "synthetic", capacity=10, feature_dim=4, num_classes=3) as writer:
        f, z = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)
        writer.append(f[:4], z[:4], np.arange(4), np.arange(4))
        writer.append(torch.from_numpy(f[4:]), torch.from_numpy(z[4:]), torch.arange(4, 6), torch.arange(4, 6))
        assert writer.rows == 6 and writer.tmp_path.name.startswith("synthetic.tmp-")
        store = writer.commit({"note": "hi"})
    assert store.n == 6 and store.meta["note"] == "hi"
    np.testing.assert_array_equal(store.features, f)
    np.testing.assert_array_equal(store.predictions, z.argmax(axis=1))

    with pytest.raises(ValueError, match="exceed the capacity"):
        with StoreWriter(tmp_path, "too-many", capacity=2, feature_dim=4, num_classes=3) as writer:
            writer.append(f[:3], z[:3], np.arange(3), np.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["synthetic"]


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@cuda
def test_cuda_extraction_restores_model_device_and_matches_cpu(tmp_path):
    model = TinyCNN()
    model.train()
    backbone = TinyBackbone(model=model)
    dataset = ListDataset(n=20)
    on_cpu = extract(backbone, dataset, tmp_path / "cpu", batch_size=8)
    on_gpu = extract(backbone, dataset, tmp_path / "gpu", batch_size=8, device="cuda", num_workers=2)
    assert model.conv.weight.device.type == "cpu" and model.training and model.bn.running_mean.device.type == "cpu"
    assert on_gpu.meta["device"].startswith("cuda")
    np.testing.assert_allclose(on_gpu.features, on_cpu.features, rtol=1e-2, atol=1e-3)  # cuDNN may use TF32
    np.testing.assert_array_equal(on_gpu.indices, on_cpu.indices)

    bf16 = extract(
        backbone, dataset, tmp_path / "gpu", batch_size=8, device="cuda", precision="bf16", channels_last=True
    )
    assert bf16.key != on_gpu.key
    np.testing.assert_allclose(bf16.features, on_cpu.features, rtol=5e-2, atol=5e-2)
    assert model.conv.weight.device.type == "cpu" and model.conv.weight.is_contiguous()


@pytest.mark.cuda
@cuda
def test_cuda_model_restored_after_failure(tmp_path):
    model = TinyCNN()
    backbone = TinyBackbone(model=model)
    with pytest.raises(RuntimeError, match="disk error"):
        extract(backbone, ListDataset(n=6, fail_at=3), tmp_path, batch_size=2, device="cuda")
    assert model.conv.weight.device.type == "cpu" and model.training


@pytest.mark.cuda
@cuda
def test_cuda_batches_and_device_split_fit_like_cpu(tmp_path):
    dataset = ListDataset(n=30, seed=3)
    store = extract(TinyBackbone(), dataset, tmp_path, batch_size=8)
    batches = store.batches(batch_size=7, device="cuda")
    first = list(batches)
    assert all(b.features.is_cuda and b.labels.is_cuda for b in first)
    torch.testing.assert_close(torch.cat([b.features for b in first]).cpu(), torch.from_numpy(np.array(store.features)))
    cpu = create("mahalanobis").fit(store.batches())
    gpu = create("mahalanobis").fit(batches)
    torch.testing.assert_close(
        gpu.score(store.batches(device="cuda")), cpu.score(store.batches()), rtol=1e-3, atol=1e-3
    )
    split = store.to_device("cuda")
    resident = create("mahalanobis").fit(split.batches(batch_size=7))
    torch.testing.assert_close(resident.score(split.batches()), cpu.score(store.batches()), rtol=1e-3, atol=1e-3)


def test_free_gpu_memory_counts_what_the_caching_allocator_holds_unused():
    from oodviz.engine.store.batches import available_bytes

    gib = 2**30
    # 10 GiB free for the driver; PyTorch reserved 30 GiB of which 12 GiB hold tensors: 18 GiB more can be had
    assert available_bytes(10 * gib, 30 * gib, 12 * gib) == 28 * gib
    assert available_bytes(10 * gib, 0, 0) == 10 * gib  # nothing cached
    assert available_bytes(10 * gib, 12 * gib, 12 * gib) == 10 * gib  # the cache is all in use


def synthetic_store(root, n=5000, d=64, c=5, seed=0):
    """A store of ``n`` random rows written directly (no model): features [n, d], logits [n, c]."""
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((n, d)).astype(np.float32)
    z = rng.standard_normal((n, c)).astype(np.float32)
    with StoreWriter(root, "synthetic", capacity=n, feature_dim=d, num_classes=c) as writer:
        writer.append(f, z, np.arange(n) % c, np.arange(n))
        return writer.commit({}), f


@pytest.mark.cuda
@cuda
def test_cuda_store_batches_stay_correct_for_a_slow_consumer_on_its_own_stream(tmp_path):
    """The copies run on the store's copy stream while the consumer (here on a stream of its own, slowed down by
    a sleep kernel before each use) still works on earlier batches: the consumer must wait for each copy, and no
    batch's memory may be reused (by a later copy) before the consumer is done with it."""
    store, f = synthetic_store(tmp_path)
    consumer = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(consumer):
        for batch in store.batches(batch_size=256, device="cuda", prefetch=2):
            torch.cuda._sleep(5_000_000)  # a few ms of GPU time: later copies run meanwhile
            sums.append(batch.features.double().sum(dim=1))
            del batch  # freed at once on the host side: only record_stream keeps its memory from the next copy
    torch.cuda.synchronize()
    np.testing.assert_allclose(torch.cat(sums).cpu().numpy(), f.astype(np.float64).sum(axis=1), rtol=1e-12)


@pytest.mark.cuda
@cuda
def test_cuda_oom_backoff_for_real(tmp_path):
    """A model whose activations at batch 8 cannot fit in an artificially capped CUDA memory."""
    free, _ = torch.cuda.mem_get_info()

    class Hungry(TinyBackbone):
        def features_and_logits(self, x):
            self.batch_sizes.append(len(x))
            if len(x) > 2:  # allocate far more than the card has: a genuine CUDA OOM
                torch.empty(int(free * 4), dtype=torch.uint8, device=x.device)
            features = self.model.features(x)
            return features, self.model.fc(features)

    backbone = Hungry()
    store = extract(backbone, ListDataset(n=9), tmp_path, batch_size=8, device="cuda")
    assert store.meta["batch_size_in_force"] == 2 and store.n == 9
    assert backbone.model.conv.weight.device.type == "cpu"
