"""CFOOD: the smallest neighbourhood fraction at which a sample is a neighbour of enough reference points.

OpenOOD's ``cfood`` postprocessor (``openood/postprocessors/cfood_postprocessor.py``, OpenOOD main, 2025; its
docstring names the method "CFOOD-based post-hoc OOD detector" and cites no paper), which this module follows.

Fit, one pass over the in-distribution features ``x`` ``[N, D]``, then passes over the kept rows on disk:

- the reference set: the L2-normalised features ``r_j = x_j / |x_j|`` of a seeded subsample, each fit row kept
  when its draw of ``numpy.random.default_rng(seed).random()`` (one draw per in-distribution row, in stream
  order) is below ``alpha``; every row when ``alpha = 1``. ``n`` rows ``[n, D]``;
- the grid of neighbourhood fractions ``kappa_m`` (100 values from 0.001 to 0.1, 81 from 0.105 to 0.5, 49 from 0.51
  to 0.99) and their ranks ``q_m = trunc(kappa_m n - 1) = max(floor(kappa_m n) - 1, 0)``, with the fractions whose rank repeats the previous one
  dropped: ``M <= 230`` of them, ``kval_`` ``[M]``;
- for every reference point, its squared distances to its ``q_m + 1``-th nearest other reference point (the sorted
  squared distances to all ``n``, itself first, at positions ``q_m + 1``): ``knn_distances_`` ``[n, M]``,
  non-decreasing along ``m``.

Score, with ``z = x / |x|`` and ``d_j = |z - r_j|^2`` (higher = more OOD):

    c_m(x)   = 1/n #{j : knn_distances_[j, m] >= d_j}                the fraction of reference points whose
                                                                     kappa_m-neighbourhood holds x
    score(x) = kappa_{m*},  m* = min {m : c_m(x) >= k}              (1 when there is none)

A sample deep inside the in-distribution data is a neighbour of many reference points at small neighbourhoods (small
score); an outlier needs large ones. OpenOOD's confidence is ``-kappa``; ``kappa`` is the OOD score. ``k`` (the
fraction of reference points, 0.01) only changes ``score``; ``alpha`` (0.1) changes the fit. The default grid is
OpenOOD's sweep, ``alpha`` in 0.1, 0.5, 1 times ``k`` in 0.001, 0.005, 0.01, 0.05.

Where this differs from OpenOOD on purpose: OpenOOD draws exactly ``int(alpha N)`` rows with ``torch.randperm`` over
all the features held in memory; the subsample here is drawn as the rows stream in (about ``alpha N`` rows, the same
rows for the same stream and seed), so the fit never holds the features. Squared distances are ``2 - 2 <z, r_j>``
(the vectors have norm 1) rather than the sum of squared differences: equal up to float32 rounding.

Memory: the reference set is a float32 file (``bank_dir`` or a temporary directory removed with the detector, as
knn's bank), and so is ``knn_distances_`` (``n x M`` float32, beside it). The self-distances are computed for blocks
of reference rows whose ``[rows, n]`` distance block stays within 64 MiB, reading the reference set once per block
(``O(n^2 D)`` work, as OpenOOD's, whose loop holds one ``[n]`` row at a time); scoring reads both files once per
``score`` call in chunks, folding each ``(query block, chunk)`` pair into per-query histograms ``[N_queries, M + 1]``
(int32) of the first ``m`` at which each reference point's neighbourhood holds the query (the counts ``c_m`` are their
cumulative sums). Not mergeable across ranks: the self-distances need the whole reference set.

OpenOOD's defaults are oodviz's (``alpha`` 0.1, ``k`` 0.01, with ``APS_mode: false``: no tuning in its evaluator;
its ``avg_topk`` is read but not used), so ``openood_params = {}`` (``protocol = "openood"`` changes nothing).
"""

import os

import numpy as np
import torch
from torch import Tensor

from oodviz.detectors import bank as bank_module
from oodviz.detectors.bank import FeatureBank, _normalise, check_chunk_size
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.teaching import Teaching


def fraction_grid() -> np.ndarray:
    """OpenOOD's neighbourhood fractions: 100 from 0.001 to 0.1, 81 from 0.105 to 0.5, 49 from 0.51 to 0.99."""
    return np.concatenate((np.linspace(0.001, 0.1, 100), np.linspace(0.105, 0.5, 81), np.linspace(0.51, 0.99, 49)))


def ranks_kept(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The fractions ``kappa_m`` ``[M]`` and ranks ``q_m = trunc(kappa_m n - 1)`` ``[M]`` of a reference set of ``n``
    rows, each rank strictly above the previous one (OpenOOD's)."""
    fractions = fraction_grid()
    ranks = np.array(fractions * n - 1, dtype=int)  # truncation toward zero, as OpenOOD's
    keep = np.concatenate(([True], ranks[:-1] < ranks[1:]))
    return fractions[keep], ranks[keep]


class CFOOD(FeatureBank):
    name = "cfood"
    summary = (
        "Smallest neighbourhood fraction at which the sample lies within the neighbourhoods of a share k of ID points."
    )
    paper = "https://github.com/Jingkang50/OpenOOD/blob/main/openood/postprocessors/cfood_postprocessor.py"
    teaching = Teaching(
        formula=(
            r"s(x) = \min \{ \kappa_m : c_m(x) \ge k \},\quad c_m(x) = \frac{1}{n} \#\{ j : \|z - r_j\|^2 \le "
            r"\rho_m(r_j) \},\quad \rho_m(r_j) = \|r_j - r_{j,(q_m + 1)}\|^2,\quad q_m = \max(\lfloor \kappa_m n \rfloor - 1, 0),\quad z = x / \|x\|"
        ),
        citation="OpenOOD contributors (no paper cited), *CFOOD postprocessor*, OpenOOD main 2025",
        reads="the features of the fit split (a subsample of them: the reference set, with each point's "
        "neighbourhood radii)",
        fails_when="The self-neighbour table costs O(n^2 D) to fit, and OOD inputs inside dense ID regions look "
        "like ID neighbours.",
    )
    fitted_shapes = {**Detector.fitted_shapes, "bank_": "ND", "knn_distances_": "NM", "kval_": "M"}
    default_grid = {"alpha": (0.1, 0.5, 1.0), "k": (0.001, 0.005, 0.01, 0.05)}
    score_params = ("k",)
    in_defaults = False  # issue 29: not in the default run

    def __init__(
        self, alpha: float = 0.1, k: float = 0.01, seed: int = 0, chunk_size: int = 16384, bank_dir: str | None = None
    ):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(
                f"cfood: alpha (the share of fit rows kept as reference points) must be in (0, 1], got {alpha!r}"
            )
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= 1:
            raise ValueError(f"cfood: k (a share of the reference points) must be in (0, 1], got {k!r}")
        if isinstance(seed, bool) or int(seed) != seed or seed < 0:
            raise ValueError(f"cfood: seed must be an integer >= 0, got {seed!r}")
        self.alpha = float(alpha)
        self.k = float(k)
        self.seed = int(seed)
        self.chunk_size = check_chunk_size(self.name, chunk_size)
        self.bank_dir = bank_dir

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """The self-distance block and its sort (values and int64 indices): ``4 x SIMILARITY_BYTES``, whatever
        ``N`` (the reference set and its radii are files)."""
        return 4 * bank_module.SIMILARITY_BYTES + super().fit_memory_bytes(n_features, n_classes, n_samples)

    # -- fit ---------------------------------------------------------------------------------
    def _fit(self, data: FitData) -> None:
        self._draws = np.random.default_rng(self.seed)
        try:
            self._write_bank(data)
        finally:
            del self._draws
        fractions, ranks = ranks_kept(len(self.bank_))
        self.kval_ = torch.from_numpy(fractions)  # float64 [M]
        self._write_neighbour_distances(ranks, data.device or torch.device("cpu"))

    def _bank_rows(self, features: Tensor, data: FitData, batch, rows: slice) -> Tensor:
        if self.alpha == 1:
            return _normalise(features)
        kept = torch.from_numpy(self._draws.random(len(features)) < self.alpha).to(features.device)
        return _normalise(features[kept])

    def _check_bank(self, rows: int) -> None:
        if rows < 2:
            raise ValueError(
                f"cfood: the reference set has {rows} row(s) (alpha={self.alpha} of the fit rows); it needs at least "
                "2: raise alpha or fit on more in-distribution data"
            )

    def _write_neighbour_distances(self, ranks: np.ndarray, device: torch.device) -> None:
        """``knn_distances_`` ``[n, M]``: each reference point's sorted squared distances to all reference points at
        positions ``ranks + 1`` (position 0 is itself), block by block of reference rows into a float32 file."""
        n = len(self.bank_)
        positions = torch.from_numpy(ranks + 1).to(device)
        step = max(1, bank_module.SIMILARITY_BYTES // (4 * n))
        path = os.path.join(os.path.dirname(self.bank_path_), f"{self.name}-radii-{id(self):x}.f32")
        resident = (
            device.type == "cuda"
            and self.bank_.nbytes <= bank_module.DEVICE_FRACTION * torch.cuda.mem_get_info(device)[0]
        )
        chunks = list(self._bank_chunks(device)) if resident else None
        with open(path, "wb") as file:
            for first in range(0, n, step):
                z = torch.from_numpy(np.array(self.bank_[first : first + step])).to(device)
                distances = torch.empty(len(z), n, device=device)
                start = 0
                for chunk in chunks if chunks is not None else self._bank_chunks(device):
                    distances[:, start : start + len(chunk)] = z @ chunk.T
                    start += len(chunk)
                distances.mul_(-2).add_(2).clamp_(min=0)  # |z - r|^2 = 2 - 2 <z, r> for unit vectors
                radii = distances.sort(dim=1).values.index_select(1, positions)
                radii.cpu().numpy().tofile(file)
        self.knn_distances_ = np.memmap(path, dtype=np.float32, mode="r", shape=(n, len(ranks)))

    # -- score -------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, batches, device=None) -> Tensor:
        """Outlier scores ``[N]`` (CPU float32, order of the batches): the smallest fraction ``kappa_m`` with
        ``c_m(x) >= k`` (1 when none); higher = more OOD. One pass over the reference set for all the batches
        (module docstring); a one-shot iterable is fine."""
        with self._staged_queries(batches, device) as (queries, device, _):
            n, width = len(self.bank_), len(self.kval_)
            # first[q, m]: the reference points whose neighbourhood holds query q from fraction m on (m = M: never)
            first = torch.zeros(len(queries), width + 1, dtype=torch.int32, device=device)
            radii, radii_start = None, None
            for rows, z, chunk, start, buffer in self._sweep(queries, device):
                if radii_start != start:  # the chunk's radii, once per chunk (query blocks are the inner loop)
                    radii = torch.from_numpy(np.array(self.knn_distances_[start : start + len(chunk)])).to(device)
                    radii_start = start
                distances = torch.mm(chunk, z.T, out=buffer[: len(z) * len(chunk)].view(len(chunk), len(z)))
                distances.mul_(-2).add_(2).clamp_(min=0)  # [chunk, q]
                # the first m with radii[j, m] >= d_j (radii non-decreasing along m)
                entered = torch.searchsorted(radii, distances, side="left")  # [chunk, q] int64
                ones = torch.ones((), dtype=torch.int32, device=device).expand(len(z), len(chunk))
                first[rows].scatter_add_(1, entered.T, ones)  # a view of first's rows: counted in place
            counts = first[:, :width].cumsum(dim=1, dtype=torch.float64) / n  # c_m(x), [N_q, M]
            reached = counts >= self.k
            found = reached.any(dim=1)
            index = reached.to(torch.int8).argmax(dim=1)  # the first m reached
            kval = self.kval_.to(device)
            return torch.where(found, kval[index], torch.ones((), dtype=kval.dtype, device=device)).float().cpu()
