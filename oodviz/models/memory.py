"""How big the feature store of a run will be, known before anything is extracted.

The store (:mod:`oodviz.engine.store`) keeps, per split of ``N`` samples: features ``N x D``
(float32, or float16 when asked), logits ``N x C`` float32 and three int64 columns (label,
prediction, dataset index). :func:`estimate_memory` adds that
up from the backbone's ``D`` and ``C`` (one probe forward for hooked layers), and
:func:`warn_if_over` turns an estimate over a budget into a message a user can act on. This is
the check that would have caught oodviz's origin bug: 50,000 ViT images x 49 x 1024 unpooled
features silently flattened (~10 GB).
"""

from __future__ import annotations

from collections.abc import Mapping

FLOAT_BYTES = 4
#: Per-sample bookkeeping in the store: label, prediction and dataset index, int64 each.
ROW_BYTES = 3 * 8
_DTYPE_BYTES = {"float32": 4, "float16": 2}


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, three significant digits (``1010 MiB`` -> ``"0.986 GiB"``,
    never ``"1.01e+03 MiB"``)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1000 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PiB"  # unreachable


class MemoryEstimate(dict):
    """The dict :func:`estimate_memory` returns, with :meth:`warn_if_over` and :meth:`describe`."""

    def warn_if_over(self, budget_bytes: int) -> str | None:
        return warn_if_over(self, budget_bytes)

    def describe(self) -> str:
        return describe_memory(self)


def estimate_memory(backbone, n_samples_per_split: Mapping[str, int], feature_dtype: str = "float32") -> MemoryEstimate:
    """Bytes the feature store needs for ``backbone`` on splits of the given sizes.

    ``backbone``: a :class:`~oodviz.models.Backbone` (anything with ``feature_dim`` and
    ``num_classes``; ``feature_shape()``, ``pooling`` and ``layer`` are used when present).
    ``n_samples_per_split``: e.g. ``{"train": 50_000, "test": 10_000, "svhn": 26_032}``.
    ``feature_dtype``: how the store keeps features, ``"float32"`` (4 bytes) or ``"float16"`` (2).

    Returns a dict: ``feature_dim``, ``num_classes``, ``raw_feature_shape`` (per-sample shape of
    the feature layer before pooling), ``pooled_dim`` (``D`` with ``pooling="avg"``),
    ``pooling``, ``default_pooling`` (what ``pooling=None`` gives the layer: :attr:`Backbone.default_pooling`), ``layer``, ``splits`` (``{name: {"n_samples", "features_bytes" (N*D*4),
    "logits_bytes" (N*C*4), "other_bytes" (N*24), "total_bytes"}}``), ``feature_dtype`` and the sums
    ``features_bytes``, ``logits_bytes``, ``other_bytes``, ``total_bytes`` (the store on disk).
    """
    if feature_dtype not in _DTYPE_BYTES:
        raise ValueError(f"feature_dtype must be one of {', '.join(_DTYPE_BYTES)}, got {feature_dtype!r}")
    d, c = int(backbone.feature_dim), int(backbone.num_classes)
    shape = backbone.feature_shape() if hasattr(backbone, "feature_shape") else None
    splits = {}
    for split, n in n_samples_per_split.items():
        n = int(n)
        if n < 0:
            raise ValueError(f"split {split!r} has a negative number of samples ({n})")
        features, logits, other = n * d * _DTYPE_BYTES[feature_dtype], n * c * FLOAT_BYTES, n * ROW_BYTES
        splits[str(split)] = {
            "n_samples": n,
            "features_bytes": features,
            "logits_bytes": logits,
            "other_bytes": other,
            "total_bytes": features + logits + other,
        }
    keys = ("features_bytes", "logits_bytes", "other_bytes", "total_bytes")
    totals = {key: sum(s[key] for s in splits.values()) for key in keys}
    return MemoryEstimate(
        name=getattr(backbone, "name", None),
        feature_dim=d,
        num_classes=c,
        raw_feature_shape=None if shape is None else shape.raw,
        pooled_dim=d if shape is None else shape.pooled_dim,
        pooling=getattr(backbone, "pooling", None),
        default_pooling=getattr(backbone, "default_pooling", None),
        layer=getattr(backbone, "layer", None),
        feature_dtype=feature_dtype,
        splits=splits,
        **totals,
    )


def _split_line(name: str, split: Mapping, d: int) -> str:
    return (
        f"{name}: {split['n_samples']:,} x {d:,} features = {format_bytes(split['features_bytes'])}"
        f" (+ logits {format_bytes(split['logits_bytes'])})"
    )


def describe_memory(estimate: Mapping) -> str:
    """A few readable lines: one per split and the total; for a run over several layers (``estimate["layers"]``:
    layer -> that layer's estimate, :func:`oodviz.pipeline.preflight.assess`), those of each layer and the sum."""
    layers = estimate.get("layers") or {None: estimate}
    lines = []
    for layer, part in layers.items():
        d = part["feature_dim"]
        if layer is not None:
            lines.append(f"layer {layer} (D={d:,}): {format_bytes(part['total_bytes'])}")
        indent = "" if layer is None else "  "
        lines += [indent + _split_line(name, s, d) for name, s in part["splits"].items()]
    total = sum(part["total_bytes"] for part in layers.values())
    where = "" if len(layers) == 1 else f" ({len(layers)} layers)"
    lines.append(f"feature store total{where}: {format_bytes(total)}")
    return "\n".join(lines)


#: how the unpooled warning names each pooling
_POOLING_WORDS = {
    "avg": "'avg'",
    "max": "'max'",
    "cls": "'cls' (the class token)",
    "mean": "'mean' (of the patch tokens)",
}


def pooling_advice(estimate: Mapping) -> str:
    """What pools the unpooled features of an estimate (``pooling="none"``): leaving ``pooling`` unset, the model's
    own (``default_pooling``: what the head reads for a layer holding a transformer's token sequence, ``avg``
    otherwise), and the other poolings that give the same ``D`` there (``cls`` / ``mean`` only on such a layer).
    E.g. ``"leaving pooling unset, the model's own: 'cls' (the class token), gives D=768 instead of 151,296 (197 x
    768 per sample, 197x smaller); so do 'avg', 'max' and 'mean' (of the patch tokens)"``."""
    d = int(estimate["feature_dim"])
    pooled, raw = int(estimate.get("pooled_dim") or d), estimate.get("raw_feature_shape")
    own = estimate.get("default_pooling") or "avg"
    tokens = own in ("cls", "mean")
    others = [_POOLING_WORDS[p] for p in ("avg", "max", "cls", "mean") if p != own and (tokens or p in ("avg", "max"))]
    shape = " x ".join(f"{s:,}" for s in raw) if raw else f"{d:,}"
    listed = others[0] if len(others) == 1 else f"{', '.join(others[:-1])} and {others[-1]}"
    return (
        f"leaving pooling unset, the model's own: {_POOLING_WORDS[own]}, gives D={pooled:,} instead of {d:,} ({shape} "
        f"per sample, {d // pooled:,}x smaller); so do{'es' if len(others) == 1 else ''} {listed}"
    )


def warn_if_over(estimate: Mapping, budget_bytes: int) -> str | None:
    """A warning naming sizes and fixes when the store would exceed ``budget_bytes``, else ``None``.

    Example: ``"The feature store would need 9.39 GiB, over the budget of 4 GiB. train: 50,000 x
    50,176 features = 9.35 GiB (+ logits 191 MiB). The features of layer 'encoder' are not pooled
    (pooling='none'): pool the features (leaving pooling unset, the model's own: 'cls' (the class token), gives
    D=256 instead of 50,176 (196 x 256 per sample, 196x smaller); so do 'avg', 'max' and 'mean' (of the patch
    tokens)) or subsample the splits."``
    """
    total = int(estimate["total_bytes"])
    if total <= budget_bytes:
        return None
    d = estimate["feature_dim"]
    splits = sorted(estimate["splits"].items(), key=lambda item: -item[1]["total_bytes"])
    parts = [
        f"The feature store would need {format_bytes(total)}, over the budget of {format_bytes(budget_bytes)}.",
        "; ".join(_split_line(name, s, d) for name, s in splits[:3]) + ("; ..." if len(splits) > 3 else "") + ".",
    ]
    pooled = estimate.get("pooled_dim") or d
    layer = estimate.get("layer")
    where = f"layer {layer!r}" if layer else "the feature layer"
    if estimate.get("pooling") == "none" and pooled < d:
        parts.append(
            f"The features of {where} are not pooled (pooling='none'): pool the features ({pooling_advice(estimate)}) "
            "or subsample the splits."
        )
    else:
        parts.append(
            "Subsample the largest splits, choose an earlier or narrower layer with a smaller D, "
            "or raise the budget if the disk has room."
        )
    return " ".join(parts)
