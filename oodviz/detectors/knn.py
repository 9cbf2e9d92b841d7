"""Deep nearest neighbours (KNN).

Sun et al., *Out-of-Distribution Detection with Deep Nearest Neighbors*, ICML 2022,
https://arxiv.org/abs/2204.06507

Fit: the bank of L2-normalised in-distribution features ``z_i = x_i / |x_i|`` ``[N, D]``.
Score, with ``z = x / |x|`` for features ``x`` ``[B, D]``:

    score(x) = |z - z_(k)|,   the Euclidean distance to the k-th nearest bank feature

The paper's confidence is the negated distance; the distance is the OOD score (higher = more
OOD). For unit vectors ``|z - z_i|^2 = 2 - 2 <z, z_i>``, so the search is a matrix product.

KNN is the one method that must keep every training feature, and keeps it on disk. Batches from
a feature store (:meth:`oodviz.engine.FeatureStore.batches`, which declare ``features_on_disk``)
need no copy: the store's own file is the bank, normalised chunk by chunk as it is searched.
Other batches are normalised and written to disk as they stream in (float32, ``bank_dir`` or a
temporary directory removed with the detector), as are store batches whose split has OOD rows
(label -1) to leave out.

Scoring reads the bank once per ``score`` call, whatever the number of query batches: the query
batches are read first, normalised in row blocks and staged in a float32 file (beside a bank it wrote, else
the system's temporary directory; the host holds one block at a time, the page cache keeps the file
in RAM when it fits), then the
bank chunks of ``chunk_size`` rows are the outer loop and query blocks the inner one, with a
running top-k ``[N_queries, k]`` float32 of cosine similarities for all queries. A store's raw
features are normalised chunk by chunk in that single pass. Query blocks have
``max(1, SIMILARITY_BYTES // (4 x chunk rows))`` rows, so the ``[q, chunk]`` similarity block stays
within ``SIMILARITY_BYTES`` (64 MiB) whether the queries come as one 50k-row batch or many small
ones. On CUDA the normalised bank is held on the device when it fits in ``DEVICE_FRACTION`` of the
free memory, else streamed in chunks through two pinned host buffers, copied on a side stream and
event-synchronised with the search (the copy of chunk ``j + 1`` overlaps the search of chunk ``j``).
The top-k candidates of every query are the same as in a per-batch search, so the scores are too.

``backend="faiss-flat"`` (exact) or ``"faiss-ivf"`` (approximate: an inverted file of
``n_lists = sqrt(N)`` k-means cells trained on up to ``64 n_lists`` bank rows, of which ``nprobe`` are
searched per query) search with FAISS (``pip install oodviz[faiss]``) on the CPU,
inner product on the normalised vectors. Its index holds the bank in RAM (``N x D`` float32), built at
each ``score`` call from the bank chunks; queries are staged and searched in blocks as above. IVF's
``nprobe`` is calibrated at each call: it starts at ``n_lists / 4`` and grows by half until, on
``CALIBRATION_QUERIES`` of the queries (seeded draw), the mean absolute difference of the k-th similarity
from an exact search is at most ``CALIBRATION_TOLERANCE`` times its standard deviation over them (all
lists, i.e. exact, at worst): features without cluster structure get a wide search, clustered ones a
narrow one, and the scores' ranking stays that of the exact search (AUROC within 1e-3 on
``bench/knn_scale.py``).

Split over ranks (a run on several processes, :func:`oodviz.pipeline.distributed.fit_bank_across_ranks` and
:func:`~oodviz.pipeline.distributed.search_across_ranks`), the bank is the union of shards: rank ``r`` keeps its own
contiguous rows of the fit split as its bank (:meth:`KNN.fit_shard`; the memory map of those rows of the
store, no copy, when they are all in-distribution), so bank reads per rank are ``1/W`` of the bank; every
rank searches every query against its shard (:meth:`KNN.top_similarities`: the ``k`` largest inner products
with its rows, ``-inf`` where the shard has fewer than ``k``), and rank 0 merges the ``W`` lists
(:meth:`KNN.merge_top`: the ``k`` largest of their union, which are the ``k`` largest over the whole bank, since
every row of the bank is in exactly one shard), then applies :meth:`KNN.scores_from_top`. ``k`` is checked
against the union's rows. A detector holding a shard refuses ``score`` (its own scores would be those of a
smaller bank).

OpenOOD v1.5's ``knn`` postprocessor computes this score on the training split, as the negated *squared* distance
(FAISS ``IndexFlatL2``; its normaliser adds 1e-10 to every component of ``x / |x|``): the same ranking. Its
default ``K = 50`` is oodviz's; its automatic search tries ``K`` in 50, 100, 200, 500, 1000 on the validation
sets, so the ``K`` behind a figure depends on the benchmark: ``openood_params`` is
empty, tune ``k`` (:mod:`oodviz.pipeline.tuning`) for the searched value.
"""

import math

import numpy as np
import torch
from torch import Tensor

from oodviz.detectors import bank as bank_module
from oodviz.detectors.bank import FeatureBank, _normalise, check_chunk_size
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.teaching import Teaching

BACKENDS = ("exact", "faiss-flat", "faiss-ivf")
#: queries drawn to calibrate IVF's nprobe against an exact search, and the tolerance (module docstring)
CALIBRATION_QUERIES, CALIBRATION_TOLERANCE = 256, 0.02


class KNN(FeatureBank):
    name = "knn"
    fitted_shapes = {**Detector.fitted_shapes, "bank_": "ND"}
    param_choices = {"backend": BACKENDS}
    summary = "Distance to the k-th nearest in-distribution feature (L2-normalised)."
    paper = "https://arxiv.org/abs/2204.06507"
    default_grid = {"k": (1, 5, 10, 20, 50, 100, 200)}
    score_params = ("k",)
    teaching = Teaching(
        formula=r"s(x) = \big\| z - z_{(k)} \big\|,\quad z = x / \|x\|",
        citation="Sun et al., *Out-of-Distribution Detection with Deep Nearest Neighbors*, ICML 2022",
        reads="the features of the fit split (all of them: the bank)",
        fails_when="Costs a search of the whole bank per query and degrades when OOD features lie in dense ID regions.",
    )
    inputs = ("features",)

    def __init__(self, k: int = 50, chunk_size: int = 16384, bank_dir: str | None = None, backend: str = "exact"):
        if int(k) != k or k < 1:
            raise ValueError(f"{self.name}: k must be a positive integer, got {k}")
        if backend not in BACKENDS:
            raise ValueError(f"knn: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.k = int(k)
        self.chunk_size = check_chunk_size(self.name, chunk_size)
        self.bank_dir = bank_dir

    def _fit(self, data: FitData) -> None:
        source = data.features_on_disk
        if source is not None:
            for _ in data:  # one pass to validate (shapes, labels, finite values) and count
                pass
            if data.rows_per_pass == len(source):  # every row in-distribution: the store is the bank
                self._keep_bank(source, normalised=False)
                return
        self._write_bank(data)

    _holds_shard = False

    @property
    def holds_shard(self) -> bool:
        """True after :meth:`fit_shard`: the bank is one shard of the whole (``score`` refuses; module docstring)."""
        return self._holds_shard

    def fit(self, batches, head=None, device=None):
        self._holds_shard = False
        return super().fit(batches, head=head, device=device)

    def fit_shard(self, batches, head=None, device=None):
        """Fit the bank of one shard (a rank's rows of the fit split), as :meth:`fit` does but with ``k`` left
        unchecked: the shard may hold fewer than ``k`` rows; check the union with :meth:`check_bank_rows`."""
        self._holds_shard = True
        return super().fit(batches, head=head, device=device)

    def check_bank_rows(self, bank_rows: int) -> None:
        """ValueError when the bank (all shards together: ``bank_rows``, which a shard remembers for later changes
        of ``k``) has fewer than ``k`` rows."""
        self._union_rows = bank_rows
        if bank_rows < self.k:
            raise ValueError(
                f"{self.name}: k={self.k} exceeds the {bank_rows} in-distribution samples; choose k <= {bank_rows}."
            )

    def _check_fitted_params(self) -> None:
        if hasattr(self, "bank_"):
            self.check_bank_rows(getattr(self, "_union_rows", len(self.bank_)) if self.holds_shard else len(self.bank_))

    def _check_bank(self, rows: int) -> None:
        if not self.holds_shard:
            self.check_bank_rows(rows)

    @torch.no_grad()
    def score(self, batches, device=None) -> Tensor:
        """Outlier scores ``[N]`` (CPU float32, order of the batches): ``|z - z_(k)|``; higher = more OOD.

        One pass over the bank for all the batches (see the module docstring); the batches are read once,
        so a one-shot iterable is fine.
        """
        if self.holds_shard:
            raise ValueError(
                f"{self.name} holds one shard of the bank (fit_shard): its own scores are not those of the whole "
                "bank; search every shard with top_similarities and merge them (oodviz.pipeline.distributed.search_across_ranks)"
            )
        return self.scores_from_top(*self.top_similarities(batches, device))

    def scores_from_top(self, best: Tensor, extra: Tensor | None) -> Tensor:
        """The scores ``[N]`` (CPU float32) from the queries' top-``k`` similarities ``best`` ``[N, k]`` (decreasing)
        and their :meth:`_query_extra` ``extra``: ``sqrt(2 - 2 best[:, k-1])``, the distance to the k-th neighbour."""
        return (2 - 2 * best[:, -1]).clamp(min=0).sqrt().float()

    @staticmethod
    def merge_top(parts: list[Tensor], k: int) -> Tensor:
        """The ``k`` largest similarities ``[N, k]`` (decreasing) of the union of several banks' top-``k`` lists
        ``parts`` (each ``[N, k]``, one per bank shard, ``-inf`` for missing neighbours): the top-``k`` of the whole bank."""
        return torch.cat(parts, dim=1).topk(k, dim=1).values

    def top_similarities(self, batches, device=None) -> tuple[Tensor, Tensor | None]:
        """The ``k`` largest inner products of each normalised query with the bank rows, ``[N, k]`` in decreasing
        order (CPU float32), and the queries' :meth:`_query_extra` ``[N]`` (or None), with the configured backend."""
        if self.backend != "exact":
            return self._faiss_top_similarities(batches)
        with self._staged_queries(batches, device) as (queries, device, extra):
            best = torch.full((len(queries), self.k), -math.inf, device=device)  # top-k inner products so far
            for rows, z, chunk, _, buffer in self._sweep(queries, device):
                block = torch.mm(z, chunk.T, out=buffer[: len(z) * len(chunk)].view(len(z), len(chunk)))
                # the top k of best and the block = the top k of best and the block's top k (no [q, chunk] copy)
                top = torch.topk(block, k=min(self.k, len(chunk)), dim=1).values
                best[rows] = torch.topk(torch.cat([best[rows], top], dim=1), k=self.k, dim=1).values
            return best.float().cpu(), extra

    def _faiss_top_similarities(self, batches) -> tuple[Tensor, Tensor | None]:
        index = self._faiss_index()
        with self._staged_queries(batches, torch.device("cpu")) as (queries, _, extra):
            if self.backend == "faiss-ivf":
                self._calibrate_nprobe(index, queries)
            step = max(1, bank_module.SIMILARITY_BYTES // (4 * self.chunk_size))
            best = np.concatenate(
                [index.search(np.array(queries[s : s + step]), self.k)[0] for s in range(0, len(queries), step)]
            )
        return torch.from_numpy(best).float(), extra

    def _calibrate_nprobe(self, index, queries: np.ndarray) -> None:
        """Raise ``index.nprobe`` until the k-th similarities of a sample of ``queries`` are those of an exact
        search within the tolerance (module docstring)."""
        drawn = np.random.default_rng(0).choice(
            len(queries), size=min(len(queries), CALIBRATION_QUERIES), replace=False
        )
        sample = np.array(queries[np.sort(drawn)])
        best = torch.full((len(sample), self.k), -2.0)
        for chunk in self._bank_chunks(torch.device("cpu")):  # exact top-k of the sample, one pass over the bank
            best = torch.cat([best, torch.from_numpy(sample) @ chunk.T], dim=1).topk(self.k, dim=1).values
        exact = best[:, -1].numpy()
        tolerance = CALIBRATION_TOLERANCE * float(exact.std())
        while index.nprobe < index.nlist:
            found = index.search(sample, self.k)[0][:, -1]
            if float(np.abs(found - exact).mean()) <= tolerance:
                break
            index.nprobe = min(index.nlist, math.ceil(index.nprobe * 1.5))

    def _faiss_index(self):
        """A FAISS inner-product index of the normalised bank (flat, or IVF trained on a sample of it)."""
        try:
            import faiss
        except ImportError:
            raise ValueError(
                f"knn: backend={self.backend!r} needs FAISS: pip install 'oodviz[faiss]' (faiss-cpu), "
                "or use backend='exact'."
            ) from None
        n_rows, dim = self.bank_.shape
        if self.backend == "faiss-flat":
            index = faiss.IndexFlatIP(dim)
        else:
            n_lists = max(1, min(n_rows // 39, round(n_rows**0.5)))  # FAISS wants >= 39 training rows per cell
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, n_lists, faiss.METRIC_INNER_PRODUCT)
            sample = np.random.default_rng(0).choice(n_rows, size=min(n_rows, 64 * n_lists), replace=False)
            training = torch.from_numpy(np.array(self.bank_[np.sort(sample)]))
            index.train(_normalise(training).numpy())
            index.nprobe = max(1, n_lists // 4)
        for chunk in self._bank_chunks(torch.device("cpu")):
            index.add(chunk.numpy())
        return index
