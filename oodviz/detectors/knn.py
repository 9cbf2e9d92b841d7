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
(label -1) to leave out. Scoring walks the bank in chunks of ``chunk_size`` rows through a memory
map, keeping a running top-k, so neither fit nor score holds ``N x D`` in RAM.
"""

import os
import shutil
import tempfile
import weakref

import numpy as np
import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.stats import row_blocks


def _normalise(x: Tensor) -> Tensor:
    return x.float() / x.float().norm(dim=1, keepdim=True).clamp(min=1e-12)


class KNN(Detector):
    name = "knn"
    summary = "Distance to the k-th nearest in-distribution feature (L2-normalised)."
    paper = "https://arxiv.org/abs/2204.06507"
    inputs = ("features",)

    def __init__(self, k: int = 50, chunk_size: int = 16384, bank_dir: str | None = None):
        for label, value in (("k", k), ("chunk_size", chunk_size)):
            if int(value) != value or value < 1:
                raise ValueError(f"knn: {label} must be a positive integer, got {value}")
        self.k = int(k)
        self.chunk_size = int(chunk_size)
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

    def _write_bank(self, data: FitData) -> None:
        """Stream the L2-normalised features into a float32 file and keep it as a memory map."""
        directory = self.bank_dir or tempfile.mkdtemp(prefix="oodviz-knn-")
        if self.bank_dir is None:
            # The bank lives as long as this detector.
            weakref.finalize(self, shutil.rmtree, directory, True)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"knn-bank-{id(self):x}.f32")
        rows, dim = 0, None
        with open(path, "wb") as file:
            for batch in data:
                dim = batch.features.shape[1]
                for block in row_blocks(len(batch.features), dim, itemsize=4):
                    _normalise(batch.features[block]).cpu().numpy().tofile(file)
                rows += len(batch.features)
        self._keep_bank(np.memmap(path, dtype=np.float32, mode="r", shape=(rows, dim)), normalised=True)

    def _keep_bank(self, bank: np.ndarray, normalised: bool) -> None:
        if len(bank) < self.k:
            raise ValueError(
                f"knn: k={self.k} exceeds the {len(bank)} in-distribution samples; choose k <= {len(bank)}."
            )
        self.bank_ = bank  # [N, D] memory map
        self.bank_path_ = str(bank.filename)
        self.bank_normalised_ = normalised  # False: the feature store's raw features, normalised as read

    def _score(self, batch: Batch) -> Tensor:
        z = _normalise(batch.features)
        best = torch.full((len(z), 0), -2.0, device=z.device)  # top-k cosine similarities so far
        for start in range(0, len(self.bank_), self.chunk_size):
            chunk = torch.from_numpy(np.array(self.bank_[start : start + self.chunk_size])).to(z.device)
            if not self.bank_normalised_:
                chunk = _normalise(chunk)
            candidates = torch.cat([best, z @ chunk.T], dim=1)
            best = torch.topk(candidates, k=min(self.k, candidates.shape[1]), dim=1).values
        kth_similarity = best[:, -1]
        return (2 - 2 * kth_similarity).clamp(min=0).sqrt()
