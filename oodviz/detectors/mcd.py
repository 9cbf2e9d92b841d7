"""Monte-Carlo dropout: average the softmax of several forward passes with dropout active.

Gal & Ghahramani, *Dropout as a Bayesian Approximation: Representing Model Uncertainty in Deep
Learning*, ICML 2016, https://arxiv.org/abs/1506.02142

Runs the classifier again (a model-based detector, see :class:`~oodviz.detectors.base.ModelDetector`)
``N = samples`` times on the same inputs ``x`` ``[B, ...]`` (``Batch.inputs``), each time with new
dropout masks; ``p_n = softmax(f_n(x))`` ``[B, C]`` is the ``n``-th pass. As pytorch-ood 0.4's ``MCD``:

- ``mode="mean"`` (default): ``score(x) = -max_k (1/N) sum_n p_n,k(x)``, the negative maximum of
  the mean softmax (the paper's predictive distribution's confidence, negated);
- ``mode="var"``: ``score(x) = 1/C sum_k Var_n(p_n,k(x))``, the per-class variance over the passes
  with Bessel's correction (``N - 1``), averaged over the classes (as in Bayesian SegNet). This is
  pytorch-ood's default mode; oodviz defaults to ``"mean"``.

``average="logits"`` (with ``mode="mean"``) averages the passes' logits before the softmax instead:
``score(x) = -max_k softmax((1/N) sum_n f_n(x))_k``, the maximum softmax of the mean logits, negated.

OpenOOD v1.5's ``dropout`` postprocessor (``openood/postprocessors/dropout_postprocessor.py``; its ``mcd`` is
another method, Maximum Classifier Discrepancy, trained with outliers) computes that: ``dropout_times`` (5) forwards
of its ``DropoutNet``, the logits averaged, then the maximum softmax as the confidence:
``openood_params = {"average": "logits", "samples": 5}`` (``protocol = "openood"``). Its dropout is part of its
network, not of the postprocessor (whose ``dropout_p`` is not read): ``DropoutNet`` applies
``F.dropout2d(features, p, training=True)`` (``p = 0.5``, the network config's ``dropout_p``) to the pooled
penultimate features ``[B, D]`` before ``fc``, which on a 2-D input drops single activations as ``nn.Dropout(p)``
does (the same masks from the same random state). oodviz switches on the model's own dropout modules with their own
``p``: a model with ``nn.Dropout(0.5)`` just before its head runs OpenOOD's passes.

Higher = more OOD in both modes. The passes run one after another on the whole batch (``N``
batched forwards, never one sample at a time); sums are accumulated in float64.

Which layers are stochastic: the model is put in eval mode and only its dropout modules
(``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout``, ``FeatureAlphaDropout``) are switched to
training mode, so BatchNorm keeps its running statistics (pytorch-ood's ``batch_norm=True``, for
a model given in eval mode). Train/eval flags and devices are restored afterwards, also after an
error. A model without dropout modules is a ValueError: it would give ``N`` identical passes
(dropout written as ``F.dropout(x, training=...)`` inside ``forward`` cannot be switched on).

``seed``: the dropout masks of one ``score`` call come from a generator seeded with it: the generator of the
device the model runs on (``cuda:N`` for a model on GPU ``N``, see ``rng_device``) and the CPU's are seeded, and
saved and restored around the call; other GPUs' are not touched. ``None`` draws from the global random state.
The same inputs in the same batches give the same scores. A sample's masks are drawn by its place in the call's
stream, though: in other batches (another ``batch_size``, or another number of rows passed at once, which a run
chooses from the free memory and records in ``detectors.json``) it gets other masks, and its score moves within
the Monte-Carlo noise of ``samples`` passes. Shapes: ``inputs`` ``[B, C_in, ...]`` -> scores ``[B]``.
"""

import itertools

import torch
from torch import Tensor, nn

from oodviz.batch import Batch
from oodviz.detectors.base import ModelDetector
from oodviz.detectors.teaching import Teaching

MODES = ("mean", "var")
#: what the passes average before the maximum (``mode="mean"``): the softmax (the paper's) or the logits (OpenOOD's)
AVERAGES = ("probabilities", "logits")
DROPOUT_TYPES = (nn.modules.dropout._DropoutNd,)
#: TorchScript keeps the Python class name of scripted submodules in ``original_name``
DROPOUT_NAMES = {"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout"}


def dropout_modules(model) -> list[nn.Module]:
    """The dropout modules of an ``nn.Module`` (with a probability above 0), in module order."""
    if not isinstance(model, nn.Module):
        return []
    found = []
    for module in model.modules():
        if isinstance(module, DROPOUT_TYPES) or getattr(module, "original_name", None) in DROPOUT_NAMES:
            if float(getattr(module, "p", 1.0)) > 0:
                found.append(module)
    return found


def rng_device(module: nn.Module | None, device: torch.device) -> torch.device:
    """The device whose random generator draws the dropout masks: where ``module``'s first parameter or buffer
    lives (the forward runs there), else ``device``; a bare ``cuda`` is the current CUDA device."""
    tensors = [] if module is None else itertools.chain(module.parameters(), module.buffers())
    used = next((t.device for t in tensors), device)
    if used.type == "cuda" and used.index is None:
        used = torch.device("cuda", torch.cuda.current_device())
    return used


class _DropoutOn:
    """Switch the dropout modules to training mode and seed the random state of ``device`` (and the CPU's);
    undo both afterwards. Only those generators are seeded and restored: the other GPUs' are left alone."""

    def __init__(self, modules: list[nn.Module], seed: int | None, device: torch.device):
        self.modules, self.seed, self.device = modules, seed, device
        self.rng = None

    def __enter__(self):
        self.flags = [(m, m.training) for m in self.modules]
        if self.seed is not None:
            cuda = self.device.type == "cuda"
            self.rng = torch.random.fork_rng(devices=[self.device.index] if cuda else [])
            self.rng.__enter__()
            if cuda:
                torch.default_generator.manual_seed(self.seed)
                with torch.cuda.device(self.device.index):
                    torch.cuda.manual_seed(self.seed)
            elif self.device.type == "cpu":
                torch.default_generator.manual_seed(self.seed)
            else:  # other accelerators: torch seeds (but does not fork) them all
                torch.manual_seed(self.seed)
        for module in self.modules:
            module.train()
        return self

    def __exit__(self, *exc):
        for module, flag in self.flags:
            module.train(flag)
        if self.rng is not None:
            self.rng.__exit__(*exc)
        return False


class MCD(ModelDetector):
    name = "mcd"
    param_choices = {"mode": MODES, "average": AVERAGES}
    openood_params = {"average": "logits", "samples": 5}
    summary = (
        "Negative max of the mean softmax over forward passes with dropout on (runs the model; needs dropout layers)."
    )
    paper = "https://arxiv.org/abs/1506.02142"
    teaching = Teaching(
        formula=r"s(x) = -\max_k \bar p_k,\quad \bar p = \frac{1}{N}\sum_{n=1}^{N} \operatorname{softmax}(f_n(x))",
        citation="Gal & Ghahramani, *Dropout as a Bayesian Approximation: Representing Model Uncertainty in Deep Learning*, ICML 2016",
        reads="the model itself, run N times with dropout on",
        fails_when="Needs dropout in the model, costs N forward passes, and dropout noise rarely separates far-OOD inputs.",
    )
    #: most classifiers (ResNets, the bundled digits-cnn) have no dropout: not in a run's default list
    in_defaults = False

    def __init__(
        self, samples: int = 30, mode: str = "mean", seed: int | None = 0, average: str = "probabilities", model=None
    ):
        minimum = 2 if mode == "var" else 1
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < minimum:
            raise ValueError(
                f"mcd: samples is the number of forward passes and must be an integer >= {minimum}"
                f"{' for mode=var' if mode == 'var' else ''}, got {samples!r}"
            )
        if mode not in MODES:
            raise ValueError(
                f"mcd: mode must be one of {MODES} ('mean': -max mean softmax, 'var': mean variance), got {mode!r}"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"mcd: seed must be an integer or None (the global random state), got {seed!r}")
        if average not in AVERAGES:
            raise ValueError(
                f"mcd: average must be one of {AVERAGES} (what the passes average before the softmax's maximum: "
                f"'probabilities' the paper's, 'logits' OpenOOD's), got {average!r}"
            )
        if average == "logits" and mode != "mean":
            raise ValueError(
                "mcd: average='logits' (OpenOOD's dropout score, the maximum softmax of the mean logits) is a score of "
                "mode='mean'; mode='var' is the variance of the passes' softmax"
            )
        self.samples = samples
        self.mode = mode
        self.seed = seed
        self.average = average
        super().__init__(model)

    def _check_fit_model(self, model) -> None:
        if not dropout_modules(self.module):
            what = type(self.module or model).__name__
            raise ValueError(
                f"mcd needs dropout layers to sample from, but the model ({what}) has no nn.Dropout module with p > 0; "
                "choose a model trained with dropout (e.g. vgg16, efficientnet, vit, mobilenet_v3), or another detector."
            )

    def _scoring(self, device: torch.device):
        return _DropoutOn(dropout_modules(self.module), self.seed, rng_device(self.module, device))

    def _score(self, batch: Batch) -> Tensor:
        total = total_sq = None
        if self.average == "logits":  # OpenOOD's: the softmax of the mean logits
            for _ in range(self.samples):
                logits = self.logits(batch.inputs).double()
                total = logits if total is None else total + logits
            return -(total / self.samples).softmax(dim=1).amax(dim=1)
        for _ in range(self.samples):
            p = self.logits(batch.inputs).softmax(dim=1).double()
            total = p if total is None else total + p
            if self.mode == "var":
                total_sq = p * p if total_sq is None else total_sq + p * p
        n = self.samples
        mean = total / n
        if self.mode == "mean":
            return -mean.amax(dim=1)
        variance = (total_sq - n * mean * mean).clamp(min=0) / (n - 1)
        return variance.mean(dim=1)
