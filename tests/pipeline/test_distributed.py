"""Runs on several processes (torch.distributed, gloo on the CPU) give the single-process answer; faults end them."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kernels import assert_kernel_close, run_batch_size

from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.engine.store import list_stores
from oodviz.pipeline.distributed import DatasetSlice, World, shard_bounds
from oodviz.runs.launch import torchrun_argv
from oodviz.runs.rundir import RunDir

EXACT_ARRAYS = ("labels", "predictions", "indices")  # a store's integer arrays: equal in every process
#: a store's float arrays: through the model in ranks of one thread each, at other batch shapes (each rank's shard)
KERNEL_ARRAYS = ("features", "logits")
ARRAY_COLUMNS = ("split", "dataset", "index", "label", "prediction")  # scores.parquet's columns before the scores


def oodviz_run(*args, cwd, timeout=600, wait=True, session=False):
    """``oodviz run ARGS`` in ``cwd``; not ``wait``: started (``session``: in a process group of its own, as a
    terminal starts a command, so that a signal to the group reaches the launcher and every rank)."""
    command = [sys.executable, "-m", "oodviz.cli", "run", *map(str, args)]
    env = dict(os.environ, OODVIZ_DIST_TIMEOUT_S="120")
    if not wait:
        return subprocess.Popen(
            command,
            cwd=str(cwd),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=session,
        )
    return subprocess.run(command, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stores_by_key(root: Path) -> dict:
    return {store.key: store for store in list_stores(root)}


def assert_same_scores(reference: Path, other: Path, some: list[str] | None = None) -> None:
    """Same rows in the same order; every detector's scores (those named in ``some`` only, when the other run has
    only those) to float32 rounding of the largest score (tests/kernels.py): the ranks' features come from other
    kernels (one thread, other batch shapes), a fit split over ranks agrees in float64 to ~1e-15 but its float32
    whitening may round one ulp apart, and rmd's score, a difference of two float32 distances, cancels."""
    a, b = pd.read_parquet(reference / "scores.parquet"), pd.read_parquet(other / "scores.parquet")
    if some is not None:
        a = a[[*ARRAY_COLUMNS, *some]]
    assert list(a.columns) == list(b.columns)
    for column in ARRAY_COLUMNS:
        assert a[column].tolist() == b[column].tolist(), column
    detectors = [c for c in a.columns if a[c].dtype.kind == "f"]
    assert len(detectors) >= (19 if some is None else len(some))
    for name in detectors:
        assert_kernel_close(b[name].to_numpy(), a[name].to_numpy(), err_msg=name)


def assert_saved_detectors_score_like_the_run(run: Path) -> None:
    """Every feature detector saved in ``run/detectors`` (by rank 0) scores the ID test store of its layer as its
    ``scores.parquet`` column says, to float32 rounding (the ranks scored their slices of the rows in one thread
    each, at other batch shapes; a single-process run's saved detectors give the bits: tests/pipeline/test_scoring.py): a
    ``<detector>@<layer>`` the layer's store (``meta.json["layers"]``), a plain name the run's. The combined
    Mahalanobis is computed from the per-layer ones, not saved."""
    from oodviz.columns import split_column
    from oodviz.detectors import detector_class, load
    from oodviz.engine import STORES_DIRNAME, open_store
    from oodviz.pipeline.scoring import COMBINED_COLUMN, detectors_dir
    from oodviz.results.tables import ID_SPLIT, load_results

    results = load_results(run)
    layer_stores = results.meta.get("layers", {}).get("stores", {})
    stored = results.scores[results.scores.split == ID_SPLIT]
    saved = sorted(p.name for p in detectors_dir(run).iterdir() if p.is_dir())
    assert saved == sorted(name for name in results.detectors if name != COMBINED_COLUMN)
    for name in saved:
        detector, layer = split_column(name)
        if detector_class(detector).needs_model:
            continue
        key = layer_stores[layer]["id_test"] if layer else results.meta["splits"]["id_test"]["store"]
        store = open_store(run.parent / STORES_DIRNAME, key)
        scores = load(detectors_dir(run) / name).score(store.batches(4096)).numpy()
        assert_kernel_close(scores, stored[name].to_numpy(), err_msg=name)


def rank_events(run: RunDir, rank: int) -> list[dict]:
    return [e for e in run.read_events() if e.get("event") == "rank" and e.get("rank") == rank]


# ---- shards ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5, 7, 100, 1001])
@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_shards_are_numpys_array_split_contiguous_disjoint_and_cover_every_row(n, size):
    expected = np.array_split(np.arange(n), size)
    for rank in range(size):
        start, stop = shard_bounds(n, rank, size)
        assert np.array_equal(np.arange(start, stop), expected[rank])


def test_a_dataset_slice_yields_the_rows_and_source_indices_of_its_range():
    class Items:
        name, classes = "toy", ["a", "b"]
        source_indices = np.arange(10) * 3

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return f"image{i}", i % 2, int(self.source_indices[i])

    part = DatasetSlice(Items(), 4, 7)
    assert len(part) == 3 and part.name == "toy" and part.classes == ["a", "b"]
    assert [part[i] for i in range(3)] == [("image4", 0, 12), ("image5", 1, 15), ("image6", 0, 18)]
    assert part.source_indices.tolist() == [12, 15, 18]
    with pytest.raises(IndexError):
        part[3]
    with pytest.raises(ValueError, match="outside the dataset's 10 items"):
        DatasetSlice(Items(), 8, 11)


def test_the_world_comes_from_torchruns_variables_and_bad_ones_are_refused():
    assert World.from_env({}) == World(0, 1, 0)
    world = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (world.rank, world.size, world.local_rank, world.is_root, world.distributed) == (3, 4, 1, False, True)
    with pytest.raises(ValueError, match="RANK=4 must be in 0..WORLD_SIZE-1"):
        World.from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="must be integers"):
        World.from_env({"RANK": "x"})


def test_torchrun_gets_standalone_on_one_node_and_the_rendezvous_on_several(tmp_path):
    one = torchrun_argv(tmp_path, 4)
    assert one[:3] == ["--standalone", "--nnodes", "1"] and one[-3:] == [
        "oodviz.pipeline.worker",
        str(tmp_path),
        "--echo",
    ]
    two = torchrun_argv(tmp_path, 2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500")
    assert two[:6] == ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29500"]
    with pytest.raises(ValueError, match="needs --rdzv-endpoint"):
        torchrun_argv(tmp_path, 2, nnodes=2)
    with pytest.raises(ValueError, match="0 <= --node-rank < --nnodes"):
        torchrun_argv(tmp_path, 2, nnodes=2, node_rank=2, rdzv_endpoint="h:1")


def test_knn_bank_shards_searched_and_merged_give_the_whole_banks_top_k_and_a_shard_refuses_to_score():
    import torch

    from oodviz import Batch
    from oodviz.detectors import create
    from oodviz.detectors.knn import KNN

    g = torch.Generator().manual_seed(0)
    bank, queries = torch.randn(40, 6, generator=g), Batch(features=torch.randn(25, 6, generator=g))
    shards = [create("knn", k=5, chunk_size=8).fit_shard(Batch(features=bank[a:b])) for a, b in ((0, 3), (3, 40))]
    merged = KNN.merge_top([shard.top_similarities(queries)[0] for shard in shards], 5)  # the first has < k rows
    z = bank.double().numpy() / np.linalg.norm(bank.double().numpy(), axis=1, keepdims=True)
    q = queries.features.double().numpy() / np.linalg.norm(queries.features.double().numpy(), axis=1, keepdims=True)
    expected = -np.sort(-(q @ z.T), axis=1)[:, :5]  # float64: the 5 largest cosine similarities over the whole bank
    np.testing.assert_allclose(merged.numpy(), expected, rtol=0, atol=1e-6)
    whole = create("knn", k=5).fit(Batch(features=bank)).score(queries).numpy()
    np.testing.assert_allclose(shards[0].scores_from_top(merged, None).numpy(), whole, rtol=1e-6)
    with pytest.raises(ValueError, match="holds one shard of the bank"):
        shards[1].score(queries)
    shards[0].check_bank_rows(40)
    with pytest.raises(ValueError, match="k=5 exceeds the 4"):
        shards[0].check_bank_rows(4)


# ---- the same answer --------------------------------------------------------------------------------------


@pytest.mark.kernels
def test_two_processes_extract_the_same_stores_and_give_the_same_scores_as_one(default_run, tmp_path):
    # cwd as the default run's: data_root resolves alike, so the stores have the same keys
    out = tmp_path / "runs" / "two"
    result = oodviz_run("--nproc-per-node", 2, "--out", out, cwd=default_run.path.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    single, sharded = stores_by_key(default_run.path.parent / ".features"), stores_by_key(out.parent / ".features")
    assert sorted(sharded) == sorted(single) and len(single) == 8
    for key, store in sharded.items():
        assert store.meta["world_size"] == 2 and [s["rows"] for s in store.meta["shards"]] == [
            (store.n + 1) // 2,
            store.n // 2,
        ]
        assert store.meta["counts"]["written"] == single[key].n
        for name in EXACT_ARRAYS:
            np.testing.assert_array_equal(store.array(name), single[key].array(name), err_msg=f"{key} {name}")
        for name in KERNEL_ARRAYS:
            assert_kernel_close(store.array(name), single[key].array(name), err_msg=f"{key} {name}")
        assert store.verify(full=True) == []
    assert_same_scores(default_run.path, out)
    assert_saved_detectors_score_like_the_run(out)
    run = RunDir(out)
    assert run.read_status()["state"] == "done"
    ends = [e for e in rank_events(run, 1) if e.get("kind") == "end"]
    assert {e["stage"] for e in ends} >= {"extract id_fit", "fit mahalanobis", "score id_test"}
    assert all(e["device"] == "cpu" and e["cpu_rss"] > 0 for e in ends)
    assert not (out / "scratch").exists()


@pytest.mark.kernels
def test_two_nodes_on_localhost_reuse_a_single_process_store_and_give_the_same_scores(default_run, tmp_path):
    """The default run's data, with three of its detectors (a logit score, class statistics and a feature bank
    merged across the nodes; every detector is merged across ranks in the test above)."""
    shutil.copytree(default_run.path.parent / ".features", tmp_path / "runs" / ".features")
    out = tmp_path / "runs" / "nodes"
    config = RunConfig()
    config.detectors = [d for d in config.detectors if d.name in ("msp", "mahalanobis", "knn")]
    config.save(tmp_path / "three.json")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        oodviz_run(
            tmp_path / "three.json",
            "--nnodes",
            2,
            "--node-rank",
            rank,
            "--rdzv-endpoint",
            endpoint,
            "--out",
            out,
            cwd=default_run.path.parent,
            wait=False,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    events = RunDir(out).read_events()
    reused = [e for e in events if e.get("event") == "progress" and e.get("reused")]
    assert len(reused) == 8  # every split's store, extracted by one process, reused by two
    assert sum(str(e.get("message")).startswith("reused store") for e in events if e.get("event") == "note") == 8
    assert_same_scores(default_run.path, out, ["msp", "mahalanobis", "knn"])


LAYERS = ["penultimate", "features.1", "features.4"]  # the first is the run's main layer, which tuning reads


@pytest.mark.process
@pytest.mark.kernels
def test_two_processes_over_three_layers_give_one_processs_stores_and_per_layer_scores(tmp_path):
    """A run over three layers of the bundled digits CNN (issue 16 with 17.3) on 1 and on 2 processes, each
    under its own runs root: every layer's stores equal (same keys, same rows; features to float32 rounding), every ``<detector>@<layer>`` and
    ``mahalanobis@combined`` within the sharded tolerances; knn's bank split per layer, vim (needs the head) at
    the penultimate layer only, msp once; knn's k tuned on validation splits, the same choice."""
    config = RunConfig(
        id_fit=DatasetChoice("digits-train", subsample=300, subsample_mode="first"),  # disjoint from id_val
        id_test=DatasetChoice("digits-test", subsample=101),  # odd: the two shards differ by one row
        ood=[DatasetChoice("noise-uniform", params={"n": 60})],
        id_val=DatasetChoice("digits-train", subsample=80, subsample_mode="last"),
        ood_val=DatasetChoice("noise-gaussian", params={"n": 40}),
        detectors=[
            DetectorChoice("msp", grid={}),
            DetectorChoice("mahalanobis", grid={}),
            DetectorChoice("knn", grid={"k": [3, 9]}),
            DetectorChoice("vim", {"dim": 16}, grid={}),
        ],
        layers=list(LAYERS),
        batch_size=run_batch_size(64),
        device="cpu",
    )
    config.save(tmp_path / "layers.json")
    outs = {procs: tmp_path / f"root{procs}" / "runs" / "run" for procs in (1, 2)}
    result = oodviz_run(tmp_path / "layers.json", "--out", outs[1], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    single = stores_by_key(outs[1].parent / ".features")
    reused = json.loads((outs[1] / "meta.json").read_text())["layers"]["stores"]["features.4"].values()
    for key in reused:  # the 2-process run finds features.4's stores and extracts the other two layers
        shutil.copytree(single[key].path, outs[2].parent / ".features" / key)
    result = oodviz_run(tmp_path / "layers.json", "--nproc-per-node", 2, "--out", outs[2], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metas = {procs: json.loads((out / "meta.json").read_text()) for procs, out in outs.items()}
    assert metas[2]["layers"] == metas[1]["layers"] and metas[2]["world_size"] == 2
    sharded = stores_by_key(outs[2].parent / ".features")
    assert sorted(sharded) == sorted(single) and len(single) == 5 * 3  # five splits (two to tune on) at three layers
    for layer, by_split in metas[2]["layers"]["stores"].items():
        for split, key in by_split.items():
            store = sharded[key]
            if layer == "features.4":
                assert "world_size" not in store.meta
            else:
                assert store.meta["world_size"] == 2 and [s["rows"] for s in store.meta["shards"]] == [
                    (store.n + 1) // 2,
                    store.n // 2,
                ]
            for name in EXACT_ARRAYS:
                np.testing.assert_array_equal(store.array(name), single[key].array(name), f"{layer} {split} {name}")
            for name in KERNEL_ARRAYS:
                assert_kernel_close(store.array(name), single[key].array(name), err_msg=f"{layer} {split} {name}")
    columns = [
        "msp",
        *(f"{detector}@{layer}" for detector in ("mahalanobis", "knn") for layer in LAYERS),
        "vim@penultimate",
        "mahalanobis@combined",
    ]
    assert list(pd.read_parquet(outs[1] / "scores.parquet").columns[len(ARRAY_COLUMNS) :]) == columns
    assert_same_scores(outs[1], outs[2], columns)
    assert_saved_detectors_score_like_the_run(outs[2])  # each <detector>@<layer> on its layer's store
    logs = [json.loads((out / "detectors.json").read_text()) for out in outs.values()]
    combined = [log["mahalanobis@combined"] for log in logs]
    assert combined[1]["layers"] == LAYERS
    for layer in LAYERS:  # the per-layer reference scores' mean and std, float64 over float32 scores
        for stat in ("mean", "std"):
            np.testing.assert_allclose(combined[1]["stats"][layer][stat], combined[0]["stats"][layer][stat], 1e-5)
    for layer in LAYERS:  # tuning on the validation splits, its bank split over the ranks: the same AUROCs, choice
        one, two = (log[f"knn@{layer}"]["tuning"] for log in logs)
        assert two["chosen"] == one["chosen"] and [r["params"] for r in two["results"]] == [{"k": 3}, {"k": 9}]
        np.testing.assert_allclose([r["auroc"] for r in two["results"]], [r["auroc"] for r in one["results"]], 1e-6)
    events = RunDir(outs[2]).read_events()
    ends = {e["stage"] for e in events if e.get("kind") == "end" and e.get("rank") == 1}
    assert ends >= {"extract id_fit", "fit knn@features.1", "fit vim@penultimate"}
    notes = [e["message"] for e in events if "note" in (e["event"], e.get("kind")) and e["stage"].startswith("fit ")]
    for rank, rows in ((0, "0..149"), (1, "150..299")):  # per layer: knn's bank split, mahalanobis and vim merged
        assert notes.count(f"fit split: rank {rank} of 2: its bank shard rows {rows} of 300") == 3
        assert notes.count(f"fit split: rank {rank} of 2: updates on rows {rows} of 300") == 4


# ---- faults ---------------------------------------------------------------------------------------------


def slow_config_file(tmp_path: Path) -> Path:
    """Extraction of 300,000 noise images: long enough to kill or cancel it midway."""
    config = RunConfig(
        ood=[DatasetChoice("noise-gaussian", params={"n": 300_000})],
        detectors=[DetectorChoice("msp"), DetectorChoice("mahalanobis")],
        batch_size=64,
        device="cpu",
    )
    path = tmp_path / "slow.json"
    config.save(path)
    return path


def wait_for(predicate, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def extracting(run: RunDir, rank: int, split: str = "ood:noise-gaussian"):
    """The pid of ``rank`` once it reports progress extracting ``split``."""
    events = [e for e in rank_events(run, rank) if e.get("kind") == "progress" and e.get("stage") == f"extract {split}"]
    return events[-1]["pid"] if events else None


@pytest.mark.process
def test_a_rank_killed_mid_extraction_fails_the_run_naming_it_and_stores_nothing(tmp_path):
    out = tmp_path / "runs" / "killed"
    launcher = oodviz_run(slow_config_file(tmp_path), "--nproc-per-node", 2, "--out", out, cwd=tmp_path, wait=False)
    run = RunDir(wait_for(lambda: (out / "events.jsonl").exists() and out))
    pid = wait_for(lambda: extracting(run, 1))
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = launcher.communicate(timeout=120)
    assert time.monotonic() - killed < 60  # no hang in a collective
    assert launcher.returncode == 1, stderr[-3000:]
    status = run.read_status()
    assert status["state"] == "failed"
    assert f"rank 1 (pid {pid}) was killed by SIGKILL" in status["error"]
    rank0 = status["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(rank0, 0)
    trusted = list_stores(out.parent / ".features")
    assert sorted(store.meta["dataset"]["name"] for store in trusted) == ["digits-test", "digits-train"]
    assert not (out / "scratch").exists()  # the shards are gone with the run's scratch


@pytest.mark.process
def test_cancel_stops_every_rank(tmp_path):
    out = tmp_path / "runs" / "cancelled"
    launcher = oodviz_run(slow_config_file(tmp_path), "--nproc-per-node", 2, "--out", out, cwd=tmp_path, wait=False)
    run = RunDir(wait_for(lambda: (out / "events.jsonl").exists() and out))
    pid = wait_for(lambda: extracting(run, 1))
    run.request_cancel()
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr[-3000:]
    assert run.read_status()["state"] == "cancelled"
    assert any(e.get("kind") == "cancelled" for e in rank_events(run, 1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.process
def test_ctrl_c_in_the_terminal_cancels_every_rank_with_one_line(tmp_path):
    """Ctrl-C: SIGINT to the command's whole process group (the launcher and each rank), as a terminal sends it."""
    out = tmp_path / "runs" / "interrupted"
    launcher = oodviz_run(
        slow_config_file(tmp_path), "--nproc-per-node", 2, "--out", out, cwd=tmp_path, wait=False, session=True
    )
    run = RunDir(wait_for(lambda: (out / "events.jsonl").exists() and out))
    pid = wait_for(lambda: extracting(run, 1))
    os.killpg(launcher.pid, signal.SIGINT)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert run.read_status()["state"] == "cancelled"
    assert "cancelled (SIGINT) after" in stderr and "Traceback" not in stderr
    assert any(e.get("kind") == "cancelled" for e in rank_events(run, 1))  # rank 1 stopped by itself, not killed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ---- merging statistics across ranks ------------------------------------------------------------------------

MERGE_SCRIPT = """
import sys
import numpy as np
import torch
from oodviz import Batch
from oodviz.detectors import available, create, detector_class
from oodviz.detectors.stats import ClassMeans, ClassMoments
from oodviz.pipeline.distributed import (World, fit_across_ranks, fit_bank_across_ranks, join_world, leave_world,
                                merge_across_ranks, search_across_ranks, shard_bounds)

world = World.from_env()
data = np.load(sys.argv[1])
x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
start, stop = shard_bounds(len(y), world.rank, world.size)
join_world(world, torch.device("cpu"))
moments, means = ClassMoments(), ClassMeans()
for first in range(start, stop, 97):  # batches of 97 rows of this rank's shard
    rows = slice(first, min(first + 97, stop))
    moments.update(x[rows], y[rows])
    means.update(x[rows], y[rows])
moments, means = merge_across_ranks(moments, world), merge_across_ranks(means, world)
fitted = {}
logits, head = torch.from_numpy(data["logits"]), (torch.from_numpy(data["weight"]), torch.from_numpy(data["bias"]))
rows = [slice(i, min(i + 97, stop)) for i in range(start, stop, 97)]
shard = [Batch(features=x[r], logits=logits[r], labels=y[r]) for r in rows]
for name in [n for n in available() if detector_class(n).mergeable]:
    detector = fit_across_ranks(create(name), shard, world, head=head, device="cpu")
    for key, value in vars(detector).items():
        if key.endswith("_") and (isinstance(value, float) or isinstance(value, torch.Tensor) and value.is_floating_point()):
            fitted[f"{name}.{key}"] = np.asarray(value)
    fitted[f"{name}.scores"] = detector.score(Batch(features=x, logits=logits)).numpy()
centred = [Batch(features=b.features - 1e3, logits=b.logits) for b in shard]  # knn: directions, not the offset
queries = [Batch(features=x[i : i + 300] - 1e3, logits=logits[i : i + 300]) for i in range(0, len(y), 300)]
for name in ("knn", "nnguide"):  # the bank split over the ranks, each searching its shard
    detector = fit_bank_across_ranks(create(name, chunk_size=128), centred, world, head=head)
    fitted[f"bank_rows-{name}"] = len(detector.bank_)
    scores = search_across_ranks(detector, queries, world)
    if world.is_root:
        fitted[f"searched-{name}"] = scores.numpy()
leave_world()
np.savez(sys.argv[2], counts=moments.counts.numpy(), means=moments.means.numpy(), within=moments.within.numpy(),
         sums=means.sums.numpy(), mean_counts=means.counts.numpy(), **fitted)
"""


@pytest.mark.process
@pytest.mark.kernels
def test_statistics_and_detector_fits_split_across_ranks_give_the_single_process_answer_on_every_rank(tmp_path):
    rng = np.random.default_rng(0)
    n, d, c = 1000, 12, 5
    y = rng.integers(0, c, n)
    y[:c] = np.arange(c)  # every class present
    x = (1e3 + rng.normal(size=(n, d)) * np.linspace(0.01, 3, d) + y[:, None]).astype(np.float32)  # a large offset
    weight, bias = rng.normal(size=(c, d)).astype(np.float32), rng.normal(size=c).astype(np.float32)
    logits = (x - 1e3) @ weight.T + bias + 3 * np.eye(c, dtype=np.float32)[y]  # mostly right: she needs it
    np.savez(tmp_path / "data.npz", x=x, y=y, logits=logits, weight=weight, bias=bias)
    script = tmp_path / "merge.py"
    script.write_text(MERGE_SCRIPT)
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "data.npz"), str(tmp_path / f"rank{r}.npz")],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    results = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    for name in ("counts", "means", "within", "sums"):
        np.testing.assert_array_equal(results[0][name], results[1][name], err_msg=name)  # every rank the same
    x64 = x.astype(np.float64)
    counts = np.bincount(y, minlength=c)
    means = np.stack([x64[y == k].mean(axis=0) for k in range(c)])
    centred = x64 - means[y]
    merged = results[0]
    np.testing.assert_array_equal(merged["counts"], counts)
    np.testing.assert_array_equal(merged["mean_counts"], counts)
    np.testing.assert_allclose(merged["means"], means, rtol=1e-12)
    np.testing.assert_allclose(merged["sums"], means * counts[:, None], rtol=1e-12)
    np.testing.assert_allclose(merged["within"], centred.T @ centred, rtol=1e-9, atol=1e-9 * np.abs(centred).max() ** 2)
    # every mergeable detector: the fit split over the two ranks = one process's fit on all rows
    import torch

    from oodviz import Batch
    from oodviz.detectors import create

    batches = [
        Batch(features=torch.from_numpy(x[i : i + 97]), logits=torch.from_numpy(logits[i : i + 97]),
              labels=torch.from_numpy(y[i : i + 97]))
        for i in range(0, n, 97)
    ]  # fmt: skip
    head = (torch.from_numpy(weight), torch.from_numpy(bias))
    names = sorted({key.split(".")[0] for key in merged.files if "." in key})
    assert names == [
        "cadref",
        "caref",
        "dice",
        "fdbd",
        "gmm",
        "klm",
        "mahalanobis",
        "nci",
        "neco",
        "openmax",
        "pnml",
        "react",
        "residual",
        "rmd",
        "she",
        "tempscale",
        "vim",
        "vra",
        "weiper",
    ]
    for name in names:
        single = create(name).fit(batches, head=head)
        keys = [key for key in merged.files if key.startswith(f"{name}.") and key != f"{name}.scores"]
        assert keys
        for key in keys:
            np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)  # the same on every rank
            value = np.asarray(getattr(single, key.split(".", 1)[1]))
            # float64 statistics (and numbers); float32 whitenings; vim's scale sums float32 projections
            tolerance = 1e-6 if key == "vim.alpha_" else 1e-9 if value.dtype == np.float64 else 1e-5
            np.testing.assert_allclose(merged[key], value, rtol=0, atol=tolerance * np.abs(value).max(), err_msg=key)
        scores = single.score(Batch(features=torch.from_numpy(x), logits=torch.from_numpy(logits))).numpy()
        np.testing.assert_allclose(merged[f"{name}.scores"], scores, rtol=1e-5, atol=1e-5 * np.abs(scores).max())
    # knn and nnguide: each rank's bank is its half; the merged top-k search = one process's search of all rows
    centred = torch.from_numpy(x - np.float32(1e3))
    for name in ("knn", "nnguide"):
        assert [int(r[f"bank_rows-{name}"]) for r in results] == [n // 2, n // 2]
        assert f"searched-{name}" not in results[1].files  # the scores are rank 0's
        single = create(name).fit([Batch(features=centred, logits=torch.from_numpy(logits))], head=head)
        expected = single.score(Batch(features=centred, logits=torch.from_numpy(logits))).numpy()
        np.testing.assert_allclose(merged[f"searched-{name}"], expected, rtol=1e-6, err_msg=name)
