"""Whether the classifier's outputs mean the ID labels, checked before any extraction (issue 26).

A checkpoint whose classes are not the ID data's (another task, another label order, a 1000-class model on a
4-class image folder) scores OOD as well as any other, but the run's ID accuracy, AURC, risk at coverage and
per-class tables compare the labels with predictions that mean something else: accuracy 0.000, AURC 1.000 for
every detector, shown as results. Two checks, the first that can decide:

- **names**: where the model and the data both name their classes, every ID class ``i`` must be the model's
  class ``i`` (:func:`oodviz.data.class_mismatch`);
- **accuracy**: else the model runs on :data:`SAMPLE` seeded ID fit images and must be right significantly more
  often than chance: the one-sided binomial tail ``P(X >= correct)``, ``X ~ Binomial(n, 1 / C)`` for its ``C``
  classes, below :data:`CHANCE_TAIL`. A model at chance or below fails; a weak but real one passes (on 64 images
  of 10 classes, 16 right, 25%, is enough).

:func:`oodviz.pipeline.preflight.preflight` refuses a run that fails (``oodviz run --force`` and the app's "Run
anyway" start it all the same), and the run checks again once its data is loaded and warns in its own log, so that
every view of it (the run page, ``oodviz runs``, the report) carries the warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from oodviz.data import class_mismatch

#: ID fit images the accuracy check runs the model on (seeded, uniform)
SAMPLE = 64
#: the largest chance probability of doing as well as the model did for it to count as better than chance
CHANCE_TAIL = 1e-3


@dataclass(frozen=True)
class ClassifierCheck:
    """What the check found: the model's ``num_classes``; ``names``, :func:`oodviz.data.class_mismatch`'s text when
    the class names disagree (then nothing was run); else ``correct`` of ``n`` sampled ID fit images predicted
    right (``n`` 0: nothing to judge by, e.g. an empty split)."""

    num_classes: int
    n: int = 0
    correct: int = 0
    names: str | None = None

    @property
    def chance_tail(self) -> float:
        """``P(X >= correct)`` for ``X ~ Binomial(n, 1 / num_classes)``: how likely chance does this well."""
        p = 1 / max(self.num_classes, 1)
        return min(
            1.0, sum(math.comb(self.n, k) * p**k * (1 - p) ** (self.n - k) for k in range(self.correct, self.n + 1))
        )

    @property
    def matches(self) -> bool:
        """The names agree (or are unknown) and the sampled accuracy is above chance (or cannot be judged)."""
        if self.names is not None:
            return False
        return self.n == 0 or self.num_classes < 2 or self.chance_tail < CHANCE_TAIL

    def problem(self) -> str | None:
        """What is wrong and what to check, for a check that fails; None when it matches."""
        if self.matches:
            return None
        if self.names is not None:
            return f"The model's classes are not the ID labels: {self.names}"
        return (
            f"The model's classes do not look like the ID labels: it predicts {self.correct} of {self.n} sampled ID "
            f"fit images right ({self.correct / self.n:.1%}), no better than chance ({1 / self.num_classes:.1%} for "
            f"its {self.num_classes} classes). ID accuracy, AURC, risk and the per-class tables compare the labels "
            "with predictions that mean something else (the OOD scores are not affected). Check that the checkpoint "
            "was trained on these classes in this order (an image folder named after the model's "
            'classes: class_map = "model")'
        )


def check_classifier(backbone, dataset, seed: int = 0, other_classes=(), sample: int = SAMPLE) -> ClassifierCheck:
    """:class:`ClassifierCheck` of ``backbone`` (on its device, in eval mode, its mode restored) on the ID ``dataset`` (items
    ``(image, label, index)``, ``None`` for an unreadable one): the names of ``dataset``'s classes and of each of
    ``other_classes`` (the ID test set's, when it is another dataset), else one forward pass of ``sample``
    seeded items drawn uniformly; items without a class (label ``-1``: an unlabelled ID set such as generated
    noise) are not judged, and a set of only those has nothing to judge by (``n`` 0)."""
    import torch  # deferred: oodviz.pipeline.preflight imports this module and keeps torch out of its own import

    names = next(
        (
            found
            for classes in (*other_classes, dataset.classes)
            if (found := class_mismatch(classes, backbone.classes))
        ),
        None,
    )
    if names is not None:
        return ClassifierCheck(backbone.num_classes, names=names)
    rows = np.sort(np.random.default_rng(seed).permutation(len(dataset))[: min(sample, len(dataset))])
    items = [item for item in (dataset[int(i)] for i in rows) if item is not None and item[1] >= 0]
    if not items:
        return ClassifierCheck(backbone.num_classes)
    inputs = torch.stack([backbone.transform(image) for image, _, _ in items]).to(backbone.device)
    model = backbone.model if isinstance(backbone.model, torch.nn.Module) else None
    training = model is not None and model.training
    if model is not None:
        model.eval()  # predictions as the run makes them (dropout off, batch-norm statistics fixed)
    try:
        with torch.inference_mode():
            _, logits = backbone.features_and_logits(inputs)
    finally:
        if training:
            model.train()
    predicted = logits.argmax(dim=1).cpu().numpy()
    correct = int((predicted == np.array([label for _, label, _ in items])).sum())
    return ClassifierCheck(backbone.num_classes, len(items), correct)
