"""NNGuide: the energy score guided by the similarity to nearest in-distribution neighbours.

Park, Jung & Teoh, *Nearest Neighbor Guidance for Out-of-Distribution Detection*, ICCV 2023,
https://arxiv.org/abs/2309.14888

Fit (features ``x`` ``[N, D]``, head ``(W [C, D], b [C])``): the bank of the L2-normalised training
features, each scaled by its confidence ``E(x) = logsumexp_k (x W^T + b)_k`` (the negated energy):

    g_i = E(x_i) x_i / |x_i|                                                     [N, D]

Score, with ``z = x / |x|`` for features ``x`` ``[B, D]``:

    guidance(x) = 1/k sum of the k largest <z, g_i>
    score(x)    = -guidance(x) E(x)

The paper's confidence is ``guidance x E``; its negation is the OOD score (higher = more OOD). As in
pytorch-ood 0.4's ``NNGuide``, the neighbours are those of largest inner product with the scaled
bank. The paper builds the bank from a random subset of the training data (1% for ImageNet): fit on
such a subset to follow it.

The bank is kept like :mod:`~oodviz.detectors.knn`'s (whose search this detector reuses): written
to disk as the fit streams in (float32, ``bank_dir`` or a temporary directory removed with the
detector), read in chunks once per ``score`` call, on the GPU when it fits, or searched by FAISS with
``backend="faiss-flat"`` / ``"faiss-ivf"``. Memory: one bank chunk and the ``[N_queries, k]`` running
top-k, whatever the size of the bank.

Split over ranks, the bank is sharded as knn's (each rank keeps the scaled rows of its shard and searches it;
rank 0 merges the top-``k`` lists exactly: :mod:`~oodviz.detectors.knn`).

OpenOOD v1.5's ``nnguide`` postprocessor computes this score with ``K = 100`` neighbours (``K: 100``, the only value
of its sweep; oodviz's default is 10): ``openood_params = {"k": 100}`` (``protocol = "openood"``). Its bank is not
the whole training split: with ``alpha: 0.01`` it keeps the first batches of its (unshuffled) training loader until
they hold more than ``int(0.01 N)`` rows, the first rows of the training list rather than a random subset. oodviz's
bank is every fit row it is given (a share of a stream would need the stream's length before the first row), so
that part is not a parameter: fit on those rows to follow it. Its normalisation adds ``1e-10`` to every coordinate
of ``x / |x|``, a change of that order.
"""

import torch
from torch import Tensor

from oodviz.detectors.base import FitData
from oodviz.detectors.knn import KNN
from oodviz.detectors.mahalanobis import l2_normalised
from oodviz.detectors.teaching import Teaching


def confidence(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``E(x) = logsumexp(x W^T + b)`` ``[B]`` (float32): the negated energy of the head's logits."""
    return torch.logsumexp(features.float() @ weight.T + bias, dim=1)


class NNGuide(KNN):
    name = "nnguide"
    summary = "Energy times the mean similarity to the k nearest confidence-scaled training features."
    paper = "https://arxiv.org/abs/2309.14888"
    default_grid = {"k": (1, 10, 50, 100)}
    score_params = ("k",)
    openood_params = {"k": 100}
    teaching = Teaching(
        formula=r"s(x) = -E(x) \cdot \frac{1}{k} \sum_{i \in \mathrm{top}_k} \langle z, g_i \rangle,\quad E(x) = \log \sum_c e^{(x W^\top + b)_c},\quad g_i = E(x_i)\, x_i / \|x_i\|",
        citation="Park, Jung & Teoh, *Nearest Neighbor Guidance for Out-of-Distribution Detection*, ICCV 2023",
        reads="the features of the fit split (the confidence-scaled bank) and the head",
        fails_when="A small or unrepresentative bank misguides it, and near-OOD inputs with close ID neighbours keep a confident score.",
    )
    needs_head = True
    in_defaults = False  # the default list is issue 17's per-backbone choice

    def __init__(self, k: int = 10, chunk_size: int = 16384, bank_dir: str | None = None, backend: str = "exact"):
        super().__init__(k=k, chunk_size=chunk_size, bank_dir=bank_dir, backend=backend)

    def _fit(self, data: FitData) -> None:
        self._write_bank(data)  # never the store's own file: its rows are scaled
        self.head_weight_, self.head_bias_ = data.head

    def _bank_rows(self, features: Tensor, data: FitData, batch=None, rows=None) -> Tensor:
        weight, bias = data.head
        return l2_normalised(features).mul_(confidence(features, weight, bias)[:, None])

    def _query_extra(self, batch) -> Tensor:
        return confidence(batch.features, self.head_weight_, self.head_bias_).cpu()

    def scores_from_top(self, best: Tensor, extra: Tensor | None) -> Tensor:
        """Outlier scores ``[N]`` (CPU float32) from the top-``k`` similarities ``best`` ``[N, k]`` and the queries'
        confidences ``extra`` ``[N]``: ``-guidance(x) E(x)``; higher = more OOD. ``score`` reads the bank once
        for all the batches, as knn's; a one-shot iterable is fine."""
        return -(best.mean(dim=1) * extra)
