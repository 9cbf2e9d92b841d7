"""Relation: the summed relation-graph edges of a sample to the in-distribution training set.

Kim et al., *Neural Relation Graph: A Unified Framework for Identifying Label Noise and Outlier Data*,
NeurIPS 2023, https://arxiv.org/abs/2301.12321 (code: https://github.com/snu-mllab/Neural-Relation-Graph; OpenOOD's
``relation`` postprocessor)

Fit (features ``x`` ``[N, D]``, the logits ``l`` ``[N, C]`` of the batches or ``x W^T + b`` of the head): the bank
of every training row's L2-normalised feature and softmax,

    z_i = x_i / |x_i|   [D],    pi_i = softmax(l_i)   [C],      bank row i = (z_i, pi_i)   [D + C]

Score, with ``z = x / |x|`` and ``pi = softmax(l)`` of a query (higher = more OOD):

    r_i(x)   = max(<z, z_i>, 0) <pi, pi_i>                       the relation kernel, in [0, 1]
    score(x) = - sum_{i : r_i(x) > t} r_i(x)^p                   [B]

``p`` (``pow``) is the kernel's temperature, tuned over 1, 2, 4, 6, 8 as OpenOOD's sweep does; ``t`` (``thres``,
0.03) cuts the small edges. The paper's and OpenOOD's score is the edge sum (higher = more in-distribution); its
negation is the OOD score. OpenOOD sums ``sign(r) |r|^p`` over ``|r| > t``: ``r`` is never negative (a clamped
cosine times an inner product of probabilities), so that is the sum above. Both ``p`` and ``t`` only change
``score``: a fitted detector takes new values without a refit.

The bank is kept and read as knn's (:mod:`oodviz.detectors.bank`): written to disk as the fit streams in (float32,
``bank_dir`` or a temporary directory removed with the detector) and read once per ``score`` call in chunks of
``chunk_size`` rows, whatever the number of queries; the sum over the bank runs chunk by chunk into a float64 total
per query. Memory: one bank chunk, one ``[q, chunk]`` block (64 MiB) and the ``[N_queries]`` totals. The fit is not
mergeable across ranks in the state protocol's sense (the bank is every row); a sharded bank would add its shards'
partial sums exactly, but no run shards it yet.

OpenOOD v1.5's ``relation`` postprocessor computes this score (its ``normalize`` divides by ``sqrt(|x|^2 + 1e-10)``)
with ``thres`` 0.03 and ``pow`` 1 by default, as here, and tunes ``pow`` on the benchmark's validation sets over the
same 1, 2, 4, 6, 8 (``APS_mode: True``): the value behind its figures depends on the benchmark (``--tune`` tries the
same grid), so ``openood_params = {}``.
"""

import torch
from torch import Tensor

from oodviz.detectors.bank import FeatureBank, _normalise, check_chunk_size
from oodviz.detectors.base import Detector, FitData
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.vim import batch_logits


class Relation(FeatureBank):
    name = "relation"
    summary = "Negated sum of the relation-graph edges (clamped cosine x softmax agreement) to every training feature."
    paper = "https://arxiv.org/abs/2301.12321"
    teaching = Teaching(
        formula=(
            r"s(x) = -\sum_{i:\, r_i > t} r_i^{\,p},\quad r_i = \max(\langle z, z_i \rangle, 0)\, \langle \pi, \pi_i"
            r" \rangle,\quad z = x / \|x\|,\quad \pi = \mathrm{softmax}(l(x))"
        ),
        citation=(
            "Kim et al., *Neural Relation Graph: A Unified Framework for Identifying Label Noise and Outlier Data*, "
            "NeurIPS 2023"
        ),
        reads="the features of the fit split (all of them: the bank, with their softmax) and the logits or the head",
        fails_when="A pass over the whole bank per query; OOD inputs mapped near ID features with an agreeing softmax look ID.",
    )
    fitted_shapes = {**Detector.fitted_shapes, "bank_": "NE"}
    optional_inputs = ("logits",)  # the model's logits, when the batches carry them
    needs_head = True
    default_grid = {"pow": (1, 2, 4, 6, 8)}
    score_params = ("pow", "thres")
    in_defaults = False  # issue 29: not in the default run

    def __init__(self, pow: float = 1, thres: float = 0.03, chunk_size: int = 16384, bank_dir: str | None = None):
        if isinstance(pow, bool) or not isinstance(pow, (int, float)) or not pow > 0:
            raise ValueError(f"relation: pow must be a number > 0, got {pow!r}")
        if isinstance(thres, bool) or not isinstance(thres, (int, float)) or not 0 <= thres < 1:
            raise ValueError(f"relation: thres must be a number in [0, 1), got {thres!r}")
        self.pow = pow
        self.thres = thres
        self.chunk_size = check_chunk_size(self.name, chunk_size)
        self.bank_dir = bank_dir

    def _fit(self, data: FitData) -> None:
        self._write_bank(data)
        self.head_weight_, self.head_bias_ = data.head

    def _bank_rows(self, features: Tensor, data: FitData, batch, rows: slice) -> Tensor:
        return self._rows(features, batch_logits(batch, *data.head, rows))

    def _query_rows(self, batch, rows: slice) -> Tensor:
        return self._rows(batch.features[rows], batch_logits(batch, self.head_weight_, self.head_bias_, rows))

    @staticmethod
    def _rows(features: Tensor, logits: Tensor) -> Tensor:
        """``(z, pi)`` ``[b, D + C]``: the L2-normalised features beside the softmax of the logits (float32)."""
        return torch.cat([_normalise(features), torch.softmax(logits.float(), dim=1)], dim=1)

    @torch.no_grad()
    def score(self, batches, device=None) -> Tensor:
        """Outlier scores ``[N]`` (CPU float32, order of the batches): ``-sum_{r_i > t} r_i^p``; higher = more OOD.
        One pass over the bank for all the batches (module docstring); a one-shot iterable is fine."""
        with self._staged_queries(batches, device) as (queries, device, _):
            dim = self.n_features_in_
            total = torch.zeros(len(queries), dtype=torch.float64, device=device)
            for rows, z, chunk, _, buffer in self._sweep(queries, device):
                r = torch.mm(z[:, :dim], chunk[:, :dim].T, out=buffer[: len(z) * len(chunk)].view(len(z), len(chunk)))
                r.clamp_(min=0).mul_(z[:, dim:] @ chunk[:, dim:].T)  # the kernel r_i, [q, chunk]
                kept = r > self.thres
                r = r.pow_(self.pow) if self.pow != 1 else r
                total[rows] += r.masked_fill_(~kept, 0).sum(dim=1, dtype=torch.float64)
            return (-total).float().cpu()
