"""GROOD: the distance, in gradient space, to the nearest correctly classified training sample.

ElAraby, Sahoo, Pequignot, Novello & Paull, *GROOD: Gradient-Aware Out-of-Distribution Detection*, TMLR 2025,
https://arxiv.org/abs/2312.14427 (code: https://github.com/mostafaelaraby/Gradient-Aware-OOD-Detection; OpenOOD's
``grood`` postprocessor, ``openood/postprocessors/grood.py``)

The nearest-class-prototype (NCP) loss of a feature ``x`` ``[D]`` over the class prototypes ``P_1..P_C`` (the mean
feature of each class) and an OOD prototype ``P_0``: with ``s_c = -|x - P_c|`` and ``pi = softmax(s)`` over the
``C + 1`` prototypes, ``L(x) = -log pi_{y(x)}`` for the predicted class ``y(x) = argmax_c l_c(x)`` (never the OOD
prototype). Its gradient with respect to the OOD prototype is, in closed form,

    g(x) = dL / dP_0 = pi_0(x) (x - P_0) / |x - P_0|                                      [D]

(``dL/ds_0 = pi_0`` as the target is never 0, ``ds_0/dP_0 = (x - P_0)/|x - P_0|``: the ``use_direct_grad`` path of
OpenOOD's code, which equals its autograd one). Fit (two passes over the in-distribution features and labels): the
prototypes ``P_c`` (float64 class means of the labelled rows), then the bank of ``g(x_i)`` of the training rows the
model classifies correctly (``y(x_i)`` equal to the label) ``[N', D]``. Score (higher = more OOD):

    score(x) = min_i |g(x) - g(x_i)|^2                                                     [B]

the squared Euclidean distance to the nearest bank gradient (OpenOOD's confidence is its negative, from a FAISS
``IndexFlatL2`` search). The logits ``l`` are the batches' own when they carry them, else ``x W^T + b`` of the head.

Where this differs from OpenOOD on purpose:

- **The OOD prototype.** OpenOOD's default (``use_val_ood``) is the mean feature of OOD validation samples, or of
  blurred uniform-noise images run through the model (``use_gaussian_noise``), or of mixup samples made inside the
  network (``use_synthetic``): all need OOD data or the model, which a post-hoc fit on in-distribution features
  has not. Here ``P_0`` is ``noise_prototype`` when given (``D`` numbers: e.g. the mean feature of an OOD
  validation set, computed by the caller), else the mean of the class prototypes (OpenOOD's ``use_proto_mean``).
- **Exact search.** OpenOOD searches an approximate FAISS IVF index (``4 sqrt(600)`` cells, 4 probed); the search
  here is exact.

The bank is kept and read as knn's (:mod:`oodviz.detectors.bank`): written to disk in the second pass (float32,
``bank_dir`` or a temporary directory removed with the detector), read once per ``score`` call in chunks into a
running minimum per query. Memory: ``O(C x D)`` for the prototypes, one bank chunk and one ``[q, chunk]`` block.
Not mergeable in the state protocol's sense: the bank is every correctly classified row (the prototypes alone
would merge by addition).

OpenOOD v1.5's ``grood`` configuration (``configs/postprocessors/grood.yaml``: its ``evaluation_api`` looks for
``grood.yml``) tunes on the benchmark's validation data (``APS_mode: True``) and takes as the OOD prototype the
mean feature of the first batches of the benchmark's OOD validation set (``use_val_ood: True``, at least
``n_noise_samples`` = 100 rows): benchmark data rather than a parameter value, so ``openood_params = {}``; give that
mean as ``noise_prototype`` to follow it.
"""

import torch
from torch import Tensor

from oodviz.detectors.bank import FeatureBank, check_chunk_size
from oodviz.detectors.base import Detector, FitData, check_all_classes_seen
from oodviz.detectors.stats import ACCUMULATE, ClassMeans
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.vim import batch_logits


def ood_prototype_gradient(features: Tensor, prototypes: Tensor, noise: Tensor) -> Tensor:
    """``g(x) = pi_0 (x - P_0) / |x - P_0|`` ``[B, D]`` (float32; computed in float64): the gradient of the NCP loss
    of the predicted class with respect to the OOD prototype ``noise`` ``[D]``, with the class prototypes
    ``prototypes`` ``[C, D]`` (float64). It does not depend on which class is predicted (``dL/ds_0 = pi_0`` for any
    target other than the OOD prototype)."""
    x = features.to(ACCUMULATE)
    offset = x - noise
    distance = offset.norm(dim=1, keepdim=True)
    scores = torch.cat([-torch.cdist(x, prototypes), -distance], dim=1)  # s_c = -|x - P_c|, OOD prototype last
    return (torch.softmax(scores, dim=1)[:, -1:] * offset / distance.clamp(min=1e-12)).float()


class GROOD(FeatureBank):
    name = "grood"
    summary = (
        "Squared distance, in the space of gradients w.r.t. an OOD prototype, to the nearest correct training sample."
    )
    paper = "https://arxiv.org/abs/2312.14427"
    teaching = Teaching(
        formula=(
            r"s(x) = \min_i \| g(x) - g(x_i) \|^2,\quad g(x) = \pi_0(x) \frac{x - P_0}{\| x - P_0 \|},\quad "
            r"\pi = \mathrm{softmax}_c(-\| x - P_c \|),\quad P_0 = \frac{1}{C} \sum_c P_c"
        ),
        citation="ElAraby, Sahoo, Pequignot, Novello & Paull, *GROOD: Gradient-Aware Out-of-Distribution Detection*, TMLR 2025",
        reads="the features and labels of the fit split (class prototypes; the bank of the correct rows' gradients) "
        "and the logits or the head",
        fails_when="Without a real OOD prototype (OOD or synthetic features) the gradient directions separate less.",
    )
    fitted_shapes = {**Detector.fitted_shapes, "bank_": "ND", "prototypes_": "CD", "ood_prototype_": "D"}
    optional_inputs = ("logits",)  # the model's predictions, when the batches carry them
    needs_head = True
    needs_labels = True
    fit_passes = 2
    in_defaults = False  # issue 29: not in the default run

    def __init__(
        self, noise_prototype: list[float] | None = None, chunk_size: int = 16384, bank_dir: str | None = None
    ):
        if noise_prototype is not None:
            try:
                values = torch.as_tensor(noise_prototype, dtype=torch.float64)
            except (TypeError, ValueError):
                values = torch.empty(0)
            if values.ndim != 1 or not len(values) or not bool(torch.isfinite(values).all()):
                raise ValueError(
                    "grood: noise_prototype must be D finite numbers (e.g. the mean feature of OOD validation "
                    f"samples), or None for the mean of the class prototypes; got {noise_prototype!r}"
                )
            noise_prototype = values.tolist()
        self.noise_prototype = noise_prototype
        self.chunk_size = check_chunk_size(self.name, chunk_size)
        self.bank_dir = bank_dir

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """The class sums and prototypes (float64, ``2 x C x D``) beside the default state."""
        return 16 * n_classes * n_features + super().fit_memory_bytes(n_features, n_classes, n_samples)

    def _fit(self, data: FitData) -> None:
        sums = ClassMeans(data.n_classes)
        for batch in data:  # pass 1: the class prototypes
            sums.update(batch.features, batch.labels)
        check_all_classes_seen(self.name, sums.empty_classes(data.n_classes), "labelled samples")
        self.prototypes_ = sums.means  # [C, D] float64
        if self.noise_prototype is None:
            self.ood_prototype_ = self.prototypes_.mean(dim=0)
        elif len(self.noise_prototype) != data.n_features:
            raise ValueError(
                f"grood: noise_prototype has {len(self.noise_prototype)} numbers but the features have "
                f"D={data.n_features}; pass one number per feature"
            )
        else:
            self.ood_prototype_ = torch.tensor(self.noise_prototype, dtype=ACCUMULATE, device=self.prototypes_.device)
        self.head_weight_, self.head_bias_ = data.head
        self._write_bank(data)  # pass 2: the gradients of the correctly classified rows

    def _gradients(self, batch, rows: slice, head) -> tuple[Tensor, Tensor]:
        logits = batch_logits(batch, *head, rows)
        return ood_prototype_gradient(batch.features[rows], self.prototypes_, self.ood_prototype_), logits

    def _bank_rows(self, features: Tensor, data: FitData, batch, rows: slice) -> Tensor:
        gradients, logits = self._gradients(batch, rows, data.head)
        return gradients[logits.argmax(dim=1) == batch.labels[rows]]

    def _check_bank(self, rows: int) -> None:
        if rows < 1:
            raise ValueError(
                "grood: no fit sample is classified correctly (the model's predicted class equal to its label), so "
                "the bank of gradients is empty; fit on labelled in-distribution data the model classifies"
            )

    def _query_rows(self, batch, rows: slice) -> Tensor:
        return self._gradients(batch, rows, (self.head_weight_, self.head_bias_))[0]

    @torch.no_grad()
    def score(self, batches, device=None) -> Tensor:
        """Outlier scores ``[N]`` (CPU float32, order of the batches): ``min_i |g(x) - g(x_i)|^2``; higher = more
        OOD. One pass over the bank for all the batches (module docstring); a one-shot iterable is fine."""
        with self._staged_queries(batches, device) as (queries, device, _):
            nearest = torch.full((len(queries),), float("inf"), device=device)
            for rows, g, chunk, _, buffer in self._sweep(queries, device):
                block = torch.mm(g, chunk.T, out=buffer[: len(g) * len(chunk)].view(len(g), len(chunk)))
                # |g - b|^2 = |g|^2 + |b|^2 - 2 <g, b>; the smallest over the chunk, then over the bank
                block.mul_(-2).add_(chunk.pow(2).sum(dim=1)).add_(g.pow(2).sum(dim=1, keepdim=True))
                nearest[rows] = torch.minimum(nearest[rows], block.min(dim=1).values)
            return nearest.clamp_(min=0).float().cpu()
