"""knn at scale (issue 13, points 3 and 4): one pass over the bank per score call, exact top-k,
bounded memory whatever the query batch size, CUDA held and streamed banks equal to the CPU."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import cuda

from oodviz import Batch
from oodviz.detectors import bank as bank_module
from oodviz.detectors import create


def brute_force(bank: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """float64 distance of each query to its k-th nearest bank row, both L2-normalised."""
    bank = bank.astype(np.float64) / np.linalg.norm(bank, axis=1, keepdims=True)
    queries = queries.astype(np.float64) / np.linalg.norm(queries, axis=1, keepdims=True)
    kth = [  # 64 queries at a time: a [64, N, D] float64 block, not [Q, N, D] (921 MB for 600 x 6000 x 32)
        np.sort(np.sqrt(((chunk[:, None, :] - bank[None, :, :]) ** 2).sum(-1)), axis=1)[:, k - 1]
        for chunk in np.array_split(queries, range(64, len(queries), 64))
    ]
    return np.concatenate(kth)


class StoreLike:
    """Re-iterable batches that declare their (raw, unnormalised) features file, as a feature store does."""

    def __init__(self, path, features: np.ndarray):
        self.features_on_disk = np.memmap(path, dtype=np.float32, mode="w+", shape=features.shape)
        self.features_on_disk[:] = features

    def __iter__(self):
        for start in range(0, len(self.features_on_disk), 64):
            yield Batch(torch.from_numpy(np.array(self.features_on_disk[start : start + 64])))


class CountingBank:
    """A bank wrapper that counts the rows read from it."""

    def __init__(self, bank: np.ndarray):
        self.bank, self.rows_read = bank, 0
        self.shape, self.nbytes = bank.shape, bank.nbytes

    def __len__(self):
        return len(self.bank)

    def __getitem__(self, rows):
        part = self.bank[rows]
        self.rows_read += len(part)
        return part


@pytest.fixture
def data():
    rng = np.random.default_rng(3)
    bank = (rng.standard_normal((300, 16)) * rng.uniform(0.5, 3, (300, 1))).astype(np.float32)
    queries = rng.standard_normal((230, 16)).astype(np.float32)
    return bank, queries


def one_shot(queries: np.ndarray, rows: int):
    return (Batch(torch.from_numpy(queries[s : s + rows])) for s in range(0, len(queries), rows))


@pytest.mark.parametrize("similarity_bytes", [4 * 37 * 5, 2**26])  # 5-row query blocks, or all at once
def test_scores_equal_a_float64_brute_force_for_written_and_store_banks(data, tmp_path, monkeypatch, similarity_bytes):
    monkeypatch.setattr(bank_module, "SIMILARITY_BYTES", similarity_bytes)
    bank, queries = data
    expected = brute_force(bank, queries, k=7)
    written = create("knn", k=7, chunk_size=37).fit([Batch(torch.from_numpy(bank))])
    store = create("knn", k=7, chunk_size=37).fit(StoreLike(tmp_path / "f.f32", bank))
    assert written.bank_normalised_ and not store.bank_normalised_
    for detector in (written, store):
        np.testing.assert_allclose(detector.score(one_shot(queries, 50)).numpy(), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(detector.score(Batch(torch.from_numpy(queries))).numpy(), expected, atol=1e-6)


def test_the_bank_is_read_once_per_score_call(data):
    bank, queries = data
    detector = create("knn", k=5, chunk_size=64).fit([Batch(torch.from_numpy(bank))])
    detector.bank_ = counting = CountingBank(detector.bank_)
    scores = detector.score(one_shot(queries, 23))  # 10 query batches
    assert counting.rows_read == len(bank)
    np.testing.assert_allclose(scores.numpy(), brute_force(bank, queries, k=5), atol=1e-6)


def test_bad_query_batches_are_refused_as_before(data):
    bank, queries = data
    detector = create("knn", k=5).fit([Batch(torch.from_numpy(bank))])
    bad = queries.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="batch 1 has 1 sample.* NaN"):
        detector.score([Batch(torch.from_numpy(queries[:10])), Batch(torch.from_numpy(bad))])
    with pytest.raises(ValueError, match="D=8, expected D=16"):
        detector.score([Batch(torch.from_numpy(queries[:, :8]))])
    with pytest.raises(ValueError, match="no samples"):
        detector.score([])


PEAK_SCRIPT = """
import sys, numpy as np, torch
from oodviz import Batch
from oodviz.detectors import create
torch.set_num_threads(1)
rng = np.random.default_rng(0)
detector = create("knn", k=50).fit([Batch(torch.from_numpy(rng.standard_normal((8192, 32)).astype(np.float32)))])
queries = torch.from_numpy(rng.standard_normal((20000, 32)).astype(np.float32))
batches = Batch(queries) if sys.argv[1] == "one" else [Batch(queries[s : s + 4096]) for s in range(0, 20000, 4096)]
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
before = status("VmRSS:")
detector.score(batches)
print(status("VmHWM:") - before)
"""


@pytest.mark.process
def test_score_memory_is_the_same_for_one_big_batch_as_for_small_batches():
    """Issue 13.3: the growth of the peak RSS while scoring 20k queries against an 8192-row bank in one Batch is
    within 10% of that in 4096-row batches (it was ~5x: a [20000, 8192] similarity block against [4096, 8192]).
    The similarity block's size does not depend on D, so D is small (32) to keep the matrix products quick; with
    the bound removed (SIMILARITY_BYTES = 2**40) the growth is ~1.3 GB and both checks fail."""
    growth = {
        shape: int(
            subprocess.run(
                [sys.executable, "-c", PEAK_SCRIPT, shape], capture_output=True, text=True, check=True
            ).stdout
        )
        for shape in ("one", "many")
    }
    assert abs(growth["one"] - growth["many"]) <= 0.1 * growth["many"], growth
    assert growth["one"] < 400 * 2**20, growth  # 64 MiB similarity blocks, not a 625 MiB one


@cuda
@pytest.mark.parametrize("fraction", [0.5, 0.0])  # bank held on the device, or streamed through pinned buffers
def test_cuda_scores_equal_cpu_scores(data, tmp_path, monkeypatch, fraction):
    monkeypatch.setattr(bank_module, "DEVICE_FRACTION", fraction)
    bank, queries = data
    for detector in (
        create("knn", k=7, chunk_size=37).fit([Batch(torch.from_numpy(bank))]),
        create("knn", k=7, chunk_size=37).fit(StoreLike(tmp_path / "f.f32", bank)),
    ):
        on_cpu = detector.score(one_shot(queries, 50))
        on_cuda = detector.score(one_shot(queries, 50), device="cuda")
        torch.testing.assert_close(on_cuda, on_cpu, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(on_cuda.numpy(), brute_force(bank, queries, k=7), atol=1e-5)


@pytest.mark.parametrize("backend", ["faiss-flat", "faiss-ivf"])
def test_faiss_backends_match_the_exact_search(backend):
    """Flat: the exact distances. IVF on clustered features (as real ones are): never a nearer k-th neighbour
    than the true one, and the AUROC of ID against OOD queries within 1e-3 of the exact search's."""
    pytest.importorskip("faiss")
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(5)
    centres = rng.standard_normal((20, 32)) * 3
    bank = (centres[rng.integers(0, 20, 6000)] + rng.standard_normal((6000, 32))).astype(np.float32)
    in_dist = centres[rng.integers(0, 20, 300)] + rng.standard_normal((300, 32))
    queries = np.concatenate([in_dist, rng.standard_normal((300, 32)) * 3]).astype(np.float32)
    expected = brute_force(bank, queries, k=10)
    scores = create("knn", k=10, backend=backend).fit([Batch(torch.from_numpy(bank))]).score(one_shot(queries, 64))
    if backend == "faiss-flat":
        np.testing.assert_allclose(scores.numpy(), expected, atol=1e-5)
    is_ood = np.repeat([0, 1], 300)
    assert (scores.numpy() >= expected - 1e-5).all()
    assert abs(roc_auc_score(is_ood, scores.numpy()) - roc_auc_score(is_ood, expected)) <= 1e-3


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of exact, faiss-flat, faiss-ivf"):
        create("knn", backend="annoy")


def test_faiss_ivf_widens_its_search_on_features_without_clusters():
    """Gaussian features with no cluster structure: a quarter of the lists misses many true neighbours (scores
    correlate 0.78 with the exact ones); the calibrated nprobe keeps the exact search's ranking."""
    pytest.importorskip("faiss")
    rng = np.random.default_rng(7)
    bank = rng.standard_normal((4000, 32)).astype(np.float32)
    queries = rng.standard_normal((600, 32)).astype(np.float32)
    expected = brute_force(bank, queries, k=10)
    scores = create("knn", k=10, backend="faiss-ivf").fit([Batch(torch.from_numpy(bank))]).score(one_shot(queries, 64))
    assert (scores.numpy() >= expected - 1e-5).all()
    assert np.corrcoef(scores.numpy(), expected)[0, 1] >= 0.99
