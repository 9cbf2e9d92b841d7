"""Mahalanobis with input pre-processing: the input nudged by epsilon towards its closest class Gaussian.

Lee, Lee, Lee & Shin, *A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial
Attacks*, NeurIPS 2018, https://arxiv.org/abs/1807.03888 (its "input pre-processing"; pytorch-ood 0.4's
``MahalanobisODIN``).

Runs the classifier again (a model-based detector with a fit, see :mod:`oodviz.detectors.model_fit`). With model
inputs ``x`` ``[B, ...]`` (``Batch.inputs``, transformed as the model expects) and their features ``f(x)``
``[B, D]`` (a Backbone's features, by default the head's input; or the first of the ``(features, logits)`` a model
returns):

**Fit** (in-distribution inputs and labels ``y`` in ``0..C-1``, one pass; OOD rows, label -1, ignored): the
Gaussians of :mod:`~oodviz.detectors.mahalanobis` on ``f(x)``, class means ``mu_k`` ``[C, D]`` and the tied covariance

    Sigma = 1/N sum_k sum_{i: y_i = k} (f_i - mu_k)(f_i - mu_k)^T        [D, D]

streamed in float64 by mahalanobis's own accumulator (:class:`~oodviz.detectors.widefit.ClassGaussianStream`) and
finished by its own code (:func:`~oodviz.detectors.mahalanobis.tied_gaussian`: the pseudo-inverse, the Gram path
for ``N <= D / 2``), so the fitted arrays are those a ``mahalanobis`` fitted on the same features holds, bit for bit.

**Score**, with ``M_k(x) = (f(x) - mu_k)^T Sigma^+ (f(x) - mu_k)`` the squared Mahalanobis distance to class ``k``:

    k_hat(x) = argmin_k M_k(x)                                          (the closest class)
    x'       = x - epsilon * sign(grad_x M_k_hat(x)) / std              (one backward pass)
    score(x) = min_k M_k(x')                                            (a second forward)

Shapes: ``inputs`` ``[B, C_in, ...]`` -> ``f`` ``[B, D]`` -> scores ``[B]``. The paper's confidence is
``M(x) = max_k -M_k(x')`` with the step ``x + epsilon sign(grad_x M(x))``: the same ``x'`` (the step moves the
input towards its closest class mean, raising the confidence of ID inputs more than of OOD ones); its negation,
the distance, is the OOD score (higher = more OOD). ``epsilon = 0`` skips the backward pass and is mahalanobis on
``f(x)``. The closest class ``k_hat`` is chosen on the unperturbed features and held fixed in the gradient (as the
paper's code, pytorch-ood and OpenOOD do); the score takes the minimum over every class again. The gradient is that
of the *sum* of the batch's distances, so a sample's step (and score) does not depend on the other samples of its
batch. Only the input gets a gradient: the model's parameters are frozen for the backward pass and put back
(they collect no ``.grad``), and the model runs in eval mode (see ``ModelDetector``). The gradient step runs with
autocast off, in the model's own precision, as odin's.

**Step size and input normalisation.** ``epsilon`` is in the units of ``std``: ``norm_std`` as odin's
(:mod:`oodviz.detectors.odin`): ``"auto"`` (default) divides the sign of the gradient of each channel by the
standard deviation of the model's normalisation when a Backbone's transform exposes one, so that ``epsilon`` is a
step in pixel units (images in ``[0, 1]``) as in the paper's code, which divides by the dataset's per-channel std
(CIFAR-10's ``(0.2023, 0.1994, 0.2010)``); otherwise ``epsilon`` is in the units of the model input, like
pytorch-ood 0.4 without ``norm_std``. OpenOOD's ``mds_ensemble`` divides by a fixed 0.5 for three channels
(``norm_std=0.5`` here). The paper tunes ``epsilon`` on validation data over the list of its code
(``m_list`` of ``OOD_Generate_Mahalanobis.py``): 0, 0.0005, 0.001, 0.0014, 0.002, 0.005, 0.01, the default
grid here; the default, 0.002, is pytorch-ood 0.4's (OpenOOD's ``mds_ensemble`` uses 0.0014).

**Against pytorch-ood 0.4** (``MahalanobisODIN``): the same ``x'`` and the same ranking, with three differences of
scale that change neither: pytorch-ood's ``Sigma`` is the unnormalised scatter plus ``1e-6 I`` (a ridge that moves
the scores by parts in a million), inverted with ``torch.linalg.inv`` (oodviz: the pseudo-inverse, as
mahalanobis); its loss is the batch *mean* of ``M_k_hat / 2`` (a positive factor: the same sign); its score is
``M / 2``. ``sign(0) = 0`` as there (the paper's code maps a zero gradient to +1; it differs only where a
gradient component is exactly zero).

**Memory.** Fit: mahalanobis's state, ``O(C D + D^2)`` float64 whatever the number of inputs, and one batch's
forward pass (no graph). Score: one batch's activations and their gradients (``activation_copies = 2``), the batch
sized from memory like odin's (a run's batch probe, else :mod:`oodviz.detectors.modelmemory`).

**Merging.** The statistics are mahalanobis's and merge exactly, but the fit runs the model on the fit images, so
this detector has no state protocol (:mod:`oodviz.detectors.protocol`): in a run split over ranks every rank fits
it on all the ID fit images, as gram and adascale. A fit split over processes, or one from a feature store without
a pass over the images, is a ``mahalanobis`` (``normalize=False``) fitted on the same features, merged across ranks
with its protocol, handed over by :meth:`MahalanobisODIN.from_mahalanobis`.

OpenOOD v1.5 has no postprocessor of this method at one layer: its ``mds`` is Mahalanobis without the input step
(oodviz's ``mahalanobis``), and its ``mds_ensemble`` takes the step at the layers of its network's feature list
(:mod:`~oodviz.detectors.mds_ensemble`, whose ``openood_params`` set OpenOOD's ``norm_std``); so
``openood_params = {}`` here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oodviz.batch import Batch
from oodviz.detectors.base import all_finite, check_all_classes_seen
from oodviz.detectors.mahalanobis import GAUSSIAN_STATE, Mahalanobis, nearest_distance, tied_gaussian
from oodviz.detectors.model_fit import FittedModelDetector, features_and_logits
from oodviz.detectors.odin import channel_std, check_norm_std, frozen, signed_step, without_autocast
from oodviz.detectors.teaching import Teaching
from oodviz.detectors.widefit import ClassGaussianStream

#: the step sizes the paper's code tries on validation data (``m_list``), ascending
EPSILON_GRID = (0.0, 0.0005, 0.001, 0.0014, 0.002, 0.005, 0.01)


def check_epsilon(name: str, epsilon) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon >= 0:
        raise ValueError(
            f"{name}: epsilon is a step size and must be >= 0 (the paper tries 0 to 0.01; pytorch-ood uses 0.002), "
            f"got {epsilon!r}"
        )
    return float(epsilon)


class MahalanobisODIN(FittedModelDetector):
    name = "mahalanobis_odin"
    fitted_shapes = {**FittedModelDetector.fitted_shapes, **Mahalanobis.fitted_shapes}
    summary = (
        "Squared Mahalanobis distance to the closest class mean of the input nudged by epsilon towards that mean "
        "(runs the model)."
    )
    paper = "https://arxiv.org/abs/1807.03888"
    default_grid = {"epsilon": EPSILON_GRID}
    score_params = ("epsilon", "norm_std")
    teaching = Teaching(
        formula=(
            r"s(x) = \min_k M_k(x'),\quad M_k(x) = (f(x) - \mu_k)^\top \Sigma^{-1} (f(x) - \mu_k),\quad "
            r"x' = x - \varepsilon\, \operatorname{sign}\big(\nabla_x M_{\hat k}(x)\big),\quad \hat k = \arg\min_k M_k(x)"
        ),
        citation="Lee et al., *A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks*, NeurIPS 2018",
        reads="the model itself (one backward, two forwards per input) and the ID inputs and labels of the fit split (class means, shared covariance)",
        fails_when="Its step size wants tuning per dataset, and near-OOD inputs in the dominant ID directions still pass, as with mahalanobis.",
    )
    needs_labels = True
    #: the default detector list by backbone family is issue 17.4's; a backward pass per input: a run lists it explicitly
    in_defaults = False
    #: the forward pass's activations, kept for the backward pass, and their gradients
    activation_copies = 2

    def __init__(self, epsilon: float = 0.002, norm_std="auto", model=None):
        self.epsilon = check_epsilon(self.name, epsilon)
        self.norm_std = check_norm_std(self.name, norm_std)
        super().__init__(model)

    @classmethod
    def fit_memory_bytes(cls, n_features: int, n_classes: int, n_samples: int) -> int:
        """Mahalanobis's: the covariance and its inverse square root (float64), the class sums and means."""
        return Mahalanobis.fit_memory_bytes(n_features, n_classes, n_samples)

    @classmethod
    def from_mahalanobis(cls, fitted: Mahalanobis, **params) -> MahalanobisODIN:
        """A fitted ``mahalanobis_odin`` (parameters ``params``, ``model=`` among them) whose Gaussians are those of
        ``fitted``, a ``mahalanobis`` with ``normalize=False`` fitted on the features this detector's model gives
        (e.g. from a run's feature store, or across ranks with its state protocol): no pass over the fit images.
        The fitted tensors are shared with ``fitted``, not copied."""
        if type(fitted) is not Mahalanobis or fitted.normalize:
            raise ValueError(
                f"{cls.name}.from_mahalanobis needs a fitted 'mahalanobis' detector with normalize=False (the "
                f"Gaussians of the features themselves), got {fitted!r}"
            )
        if not hasattr(fitted, "whitening_"):
            raise ValueError(f"{cls.name}.from_mahalanobis: the mahalanobis detector is not fitted; fit it first")
        detector = cls(**params)
        detector.head_weight_ = detector.head_bias_ = None
        for key in GAUSSIAN_STATE:
            if hasattr(fitted, key):
                setattr(detector, key, getattr(fitted, key))
        detector._set_widths()
        return detector

    def channel_std(self) -> list[float] | None:
        """The per-channel divisor of the gradient step, or None for none (see the module docstring)."""
        return channel_std(self.norm_std, self.model)

    # -- fit ---------------------------------------------------------------------------------------
    def fit_begin(self, head=None) -> None:
        """A new fit: the head is not kept (the Gaussians' classes are those of the labels, ``0..max label``, which
        may be fewer than the head's)."""
        super().fit_begin(None)
        for key in GAUSSIAN_STATE:
            self.__dict__.pop(key, None)  # a refit on the Gram path has no covariance_: none left from before
        self._stream, self._rows = ClassGaussianStream(), 0

    def features(self, x: Tensor, grad: bool = False) -> Tensor:
        """The model's features ``f(x)`` ``[B, D]`` (float32) of inputs ``x`` ``[B, ...]``; ``grad`` keeps the graph."""
        if grad:
            features, _ = features_and_logits(self._require_model(), x, grad=True)
        else:
            with torch.no_grad():
                features, _ = features_and_logits(self._require_model(), x)
        if not isinstance(features, Tensor) or features.ndim != 2 or len(features) != len(x):
            shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
            raise ValueError(
                f"{self.name}: the model gave features of shape {shape} for {len(x)} inputs; it must give features "
                "[B, D] (an oodviz Backbone pools a layer's output itself)"
            )
        return features.float()

    def fit_step(self, batch: Batch) -> Tensor:
        labels = batch.labels
        if labels is None:
            raise ValueError(
                f"{self.name} fits per class: give each input its class label, Batch(inputs=..., labels=...)"
            )
        features = self.features(batch.inputs)
        known = labels >= 0  # OOD rows, label -1, left out
        features, labels = features[known], labels[known].long()
        if not all_finite(features):
            raise ValueError(
                f"{self.name}: the model gave NaN or infinite features for some fit inputs; check the inputs and the "
                "model's precision"
            )
        if len(labels):  # the state changes only after the forward pass: a retried batch leaves it as one call would
            self._stream.update(features, labels)
            self._rows += len(labels)
        return torch.zeros(len(batch))

    def _end_pass(self, pass_index: int, values: Tensor) -> None:
        if not self._rows:
            raise ValueError(
                f"{self.name}.fit got no in-distribution inputs: the batches were empty or every label was -1 (OOD)"
            )
        moments = self._stream.release()
        self._stream = None
        check_all_classes_seen(self.name, moments.empty_classes())
        for key, value in tied_gaussian(moments).items():
            setattr(self, key, value)

    def end_pass(self, pass_index: int, values: Tensor) -> None:
        super().end_pass(pass_index, values)
        self._set_widths()

    def fit(self, batches, head=None, device=None):
        super().fit(batches, head=head, device=device)
        self._set_widths()  # the Gaussians' classes (the labels'), not the head's
        return self

    def _set_widths(self) -> None:
        self.n_features_in_, self.n_classes_ = self.class_means_.shape[1], len(self.class_means_)

    # -- score -------------------------------------------------------------------------------------
    def distance(self, features: Tensor) -> Tensor:
        """``min_k M_k`` ``[B]`` of features ``[B, D]``: the squared Mahalanobis distance to the closest class mean,
        differentiable in the features (the closest class held fixed;
        :func:`~oodviz.detectors.mahalanobis.nearest_distance`)."""
        if features.shape[1] != self.center_.shape[0]:
            raise ValueError(
                f"{self.name}: the model gives {features.shape[1]} features but the detector was fitted on "
                f"{self.center_.shape[0]}; fit it with this model"
            )
        whitened = (features.float() - self.center_) @ self.whitening_
        return nearest_distance(whitened, self.whitened_means_, self.whitened_norms_)

    def perturb(self, x: Tensor) -> Tensor:
        """``x' = x - epsilon * sign(grad_x M_k_hat(x)) / std``, same shape as ``x``, no graph."""
        with torch.inference_mode(False):
            for key in ("center_", "whitening_", "whitened_means_"):  # fitted under inference mode: not in a graph
                if torch.is_inference(getattr(self, key)):
                    setattr(self, key, getattr(self, key).clone())
            x = x.clone() if torch.is_inference(x) else x
            x = x.detach().requires_grad_(True)
            with torch.enable_grad(), frozen(self.module), without_autocast(x.device):
                loss = self.distance(self.features(x, grad=True)).sum()
                (gradient,) = torch.autograd.grad(loss, x)
            return (x - self.epsilon * signed_step(self.name, gradient, self.channel_std())).detach()

    def _score(self, batch: Batch) -> Tensor:
        x = batch.inputs
        if self.epsilon > 0:
            x = self.perturb(x)
        return self.distance(self.features(x))
