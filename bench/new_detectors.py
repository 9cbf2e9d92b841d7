"""Fit memory, fit time and scoring rate of the issue-17 detectors: oodviz against pytorch-ood 0.4.

The feature/logit-based detectors added by issue 17: vra, gmm, openmax, nnguide, weiper (variant
kld), and mahalanobis and rmd with ``normalize=True`` (MDS++); and issue 29's detectors over an ID bank on disk
(relation, cfood, grood, combood: oodviz only). Same data and measurement as
``bench/detectors.py`` (bench/harness.py: seeded class-structured features written once, each
measurement in a fresh Python process that loads them into RAM; peak RSS growth and wall time of
construct + fit), then the scoring rate (samples/s) of the fitted detector in the same process.
Each library is run with its defaults, which are the same here (vra percentiles 1/99, gmm reg 1e-6,
openmax tailsize 25, alpha 10, euclid_weight 1, nnguide k=10).

pytorch-ood 0.4 counterparts: ``VRA`` (``fit_feature_maps``/``predict_feature_maps`` on the pooled
features, the head as an ``nn.Linear``), ``GMM``, ``NNGuide`` (``fit_features``/``predict_features``),
``OpenMax`` (``fit_logits``/``predict_logits``), and ``Mahalanobis``/``RMD`` on
``F.normalize(features)`` (the normalisation inside the timed fit and scoring, as a pytorch-ood user
would write MDS++). pytorch-ood has no WeiPer: oodviz only. pytorch-ood scores fewer samples (its
OpenMax calls scipy per sample); a rate does not depend on the count.

Run (about 5 minutes on 2 CPU cores)::

    .venv/bin/python bench/new_detectors.py [--n 20000 --dim 512 --classes 100 --repeats 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import torch
from fit_memory import linear_layer
from harness import PeakGrowth, Sizes, batch_views, load_dataset, median_of_runs, run_one, warm_up_torch, write_dataset
from report import environment

# label -> (oodviz detector name, its parameters)
DETECTORS = {
    "vra": ("vra", {}),
    "gmm": ("gmm", {}),
    "openmax": ("openmax", {}),
    "nnguide": ("nnguide", {}),
    "weiper (kld)": ("weiper", {"variant": "kld"}),
    "mahalanobis normalize": ("mahalanobis", {"normalize": True}),
    "rmd normalize": ("rmd", {"normalize": True}),
    # issue 29's bank detectors (OpenOOD postprocessors; pytorch-ood 0.4 has none of them)
    "relation": ("relation", {}),
    "cfood": ("cfood", {}),
    "grood": ("grood", {}),
    "combood": ("combood", {}),
}
NOT_IN_PYTORCH_OOD = ("weiper (kld)", "relation", "cfood", "grood", "combood")
PYTORCH_OOD_SCORED = {"openmax": 500}  # samples pytorch-ood scores; others: --n-score-pytorch-ood
TIMEOUT_S = 900


def measure_oodviz(data_dir: str, label: str, n_score: int) -> dict:
    """oodviz ``create(...).fit(batch views, head=(W, b))``: peak growth and time; then samples/s of ``score``."""
    from oodviz.detectors import create

    name, params = DETECTORS[label]
    data = load_dataset(data_dir)
    batches = batch_views(data)
    head = (data["weight"], data["bias"])
    warm_up_torch()
    with torch.no_grad(), PeakGrowth() as peak:
        fitted = create(name, **params).fit(batches, head=head)
    fitted.score(batch_views(data, 64))  # warm-up
    scored = batch_views(data, n_score)
    start = time.perf_counter()
    with torch.no_grad():
        fitted.score(scored)
    seconds = time.perf_counter() - start
    return {**peak.result(), "samples_per_s": n_score / seconds}


def _pytorch_ood_fit_and_scorer(label: str, data: dict[str, torch.Tensor]):
    """Fit the pytorch-ood 0.4 counterpart of ``label``; its scoring function of the first ``n`` rows."""
    import torch.nn.functional as F
    from pytorch_ood.detector import GMM, RMD, VRA, Mahalanobis, NNGuide, OpenMax

    z, y, head = data["features"], data["labels"], data["head_layer"]
    if label == "vra":
        detector = VRA(None, head, lower_percentile=0.01, upper_percentile=0.99).fit_feature_maps(z, y)
        return lambda n: detector.predict_feature_maps(z[:n])
    if label == "gmm":
        detector = GMM(None).fit_features(z, y)
        return lambda n: detector.predict_features(z[:n])
    if label == "openmax":
        detector = OpenMax(None).fit_logits(data["logits"], y)
        return lambda n: detector.predict_logits(data["logits"][:n])
    if label == "nnguide":
        detector = NNGuide(None, head, k=10).fit_features(z, y)
        return lambda n: detector.predict_features(z[:n])
    if label in ("mahalanobis normalize", "rmd normalize"):
        detector = (Mahalanobis if label.startswith("mahalanobis") else RMD)(None).fit_features(F.normalize(z), y)
        return lambda n: detector.predict_features(F.normalize(z[:n]))
    raise ValueError(label)


def measure_pytorch_ood(data_dir: str, label: str, n_score: int) -> dict:
    """pytorch-ood 0.4 construct + fit on the whole tensors: peak growth and time; then samples/s of its predict."""
    import pytorch_ood.detector  # noqa: F401

    data = load_dataset(data_dir)
    data["head_layer"] = linear_layer(data["weight"], data["bias"])
    warm_up_torch()
    with torch.no_grad(), PeakGrowth() as peak:
        score = _pytorch_ood_fit_and_scorer(label, data)
    with torch.no_grad():
        score(8)  # warm-up
        start = time.perf_counter()
        score(n_score)
        seconds = time.perf_counter() - start
    return {**peak.result(), "samples_per_s": n_score / seconds}


def measure_rankfeat(library: str, n_images: int) -> dict:
    """Samples/s of RankFeat scoring (no fit in either library) with a random-weight torchvision resnet18 on
    ``n_images`` seeded N(0, 1) 64x64 images, in batches of 64; the rank-1 removal at ``layer4`` (2x2 maps)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=100).eval()
    images = torch.randn(n_images, 3, 64, 64)
    if library == "oodviz":
        from oodviz import Batch
        from oodviz.detectors import create

        detector = create("rankfeat", model=model, layer="layer4")
        score = lambda x: detector.score(Batch(inputs=x))  # noqa: E731
    else:
        from pytorch_ood.detector import RankFeat

        trunk = torch.nn.Sequential(*list(model.children())[:-2])  # conv1 .. layer4
        head = torch.nn.Sequential(model.avgpool, torch.nn.Flatten(1), model.fc)
        score = RankFeat(backbone=trunk, head=head).predict
    with torch.no_grad():
        score(images[:8])  # warm-up
        start = time.perf_counter()
        for i in range(0, n_images, 64):
            score(images[i : i + 64])
        seconds = time.perf_counter() - start
    return {"no_fit": True, "samples_per_s": n_images / seconds}


MODEL_CLASSES = 10  # the resnet18's classes and the labels' (arange % 10) in the model-based fits
GRAM_LAYERS = ["layer1", "layer2", "layer3", "layer4"]


def measure_model_fit(library: str, detector: str, n_images: int) -> dict:
    """Fit memory growth, fit time and samples/s of the model-based ``detector`` ("gram", "adascale") with a
    random-weight torchvision resnet18 (10 classes) on ``n_images`` seeded N(0, 1) 64x64 images, labels
    ``arange % 10``, in batches of 64; each library's defaults (gram: 10 poles, 10% held out; pytorch-ood's
    ``Gram`` runs conv1..layer1, layer2, layer3, layer4 in turn, then avgpool + fc)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=MODEL_CLASSES).eval()
    images = torch.randn(n_images, 3, 64, 64)
    labels = torch.arange(n_images) % MODEL_CLASSES
    starts = range(0, n_images, 64)
    warm_up_torch()
    if library == "oodviz":
        from oodviz import Batch
        from oodviz.detectors import create
        from oodviz.models import wrap_model

        wrapped = wrap_model(model, lambda image: image, head="fc", input_shape=(3, 64, 64), name="resnet18")
        params = {"layers": GRAM_LAYERS} if detector == "gram" else {}
        with torch.no_grad(), PeakGrowth() as peak:
            fitted = create(detector, model=wrapped, **params).fit(
                [Batch(inputs=images[i : i + 64], labels=labels[i : i + 64]) for i in starts]
            )
        score = lambda x: fitted.score(Batch(inputs=x))  # noqa: E731
    else:
        from pytorch_ood.detector import Gram

        stem = torch.nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, model.layer1)
        head = torch.nn.Sequential(model.avgpool, torch.nn.Flatten(1), model.fc)
        layers = [stem, model.layer2, model.layer3, model.layer4]
        with torch.no_grad(), PeakGrowth() as peak:
            fitted = Gram(head, layers, num_classes=MODEL_CLASSES, num_poles_list=list(range(1, 11)))
            fitted.fit([(images[i : i + 64], labels[i : i + 64]) for i in starts])
        score = fitted.predict
    with torch.no_grad():
        start = time.perf_counter()
        for i in starts:
            score(images[i : i + 64])
        seconds = time.perf_counter() - start
    return {**peak.result(), "samples_per_s": n_images / seconds}


def _cell(result: dict, key: str, digits: int) -> str:
    if "error" in result:
        return "error: " + result["error"][:60]
    text = f"{result[key]:,.{digits}f}"
    low, high = result.get(key + "_range", (result[key], result[key]))
    return text if high - low < 10**-digits else f"{text} ({low:,.{digits}f}-{high:,.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="fit samples N (oodviz scores all of them)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--n-score-pytorch-ood", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per figure; the median is reported")
    parser.add_argument(
        "--rankfeat-images", type=int, default=0, help="also RankFeat's scoring rate on this many images (0: not)"
    )
    parser.add_argument(
        "--model-images", type=int, default=0, help="also gram and adascale fits on this many images (0: not)"
    )
    parser.add_argument("--detectors", default=",".join(DETECTORS), help="comma-separated subset of the labels")
    args = parser.parse_args()
    labels = [label for label in args.detectors.split(",") if label]
    if unknown := set(labels) - set(DETECTORS):
        parser.error(f"unknown detector(s) {', '.join(sorted(unknown))}; choose from {', '.join(DETECTORS)}")
    libraries = ("oodviz", "pytorch-ood") if importlib.util.find_spec("pytorch_ood") else ("oodviz",)
    import new_detectors  # the measurements by their module name, not __main__, for the fresh processes

    sizes = Sizes(args.n, 0, args.dim, args.classes, args.n, args.n_score_pytorch_ood, TIMEOUT_S)
    print("\n".join(environment()))
    print(f"- sizes: N={args.n}, D={args.dim}, C={args.classes}, median of {args.repeats} fresh process(es)")
    started = time.perf_counter()
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="oodviz-bench17-") as data_dir:
        write_dataset(data_dir, sizes)
        for label in labels:
            results[label] = {}
            for library in libraries:
                if library == "pytorch-ood" and label in NOT_IN_PYTORCH_OOD:
                    continue
                measure = new_detectors.measure_oodviz if library == "oodviz" else new_detectors.measure_pytorch_ood
                n_score = args.n if library == "oodviz" else PYTORCH_OOD_SCORED.get(label, args.n_score_pytorch_ood)
                runs = [
                    run_one(measure, TIMEOUT_S, data_dir=data_dir, label=label, n_score=min(n_score, args.n))
                    for _ in range(args.repeats)
                ]
                results[label][library] = result = median_of_runs(runs)
                if "error" not in result:
                    result["samples_per_s"] = sorted(r["samples_per_s"] for r in runs)[len(runs) // 2]
                print(f"[{time.perf_counter() - started:.0f}s] {label} {library} {results[label][library]}", flush=True)
    if args.rankfeat_images:
        results["rankfeat (resnet18, 64 px)"] = {
            library: run_one(new_detectors.measure_rankfeat, TIMEOUT_S, library=library, n_images=args.rankfeat_images)
            for library in libraries
        }
        print(f"[{time.perf_counter() - started:.0f}s] rankfeat {results['rankfeat (resnet18, 64 px)']}", flush=True)
    for detector in ("gram", "adascale") if args.model_images else ():
        label = f"{detector} (resnet18, 64 px, {args.model_images} images)"
        results[label] = {
            library: run_one(
                new_detectors.measure_model_fit,
                TIMEOUT_S,
                library=library,
                detector=detector,
                n_images=args.model_images,
            )
            for library in libraries
            if library == "oodviz" or detector == "gram"
        }
        print(f"[{time.perf_counter() - started:.0f}s] {label} {results[label]}", flush=True)
    print(f"\nTotal {time.perf_counter() - started:.0f} s\n")
    print("| detector | library | fit growth MiB | fit s | scoring samples/s |")
    print("|---|---|---:|---:|---:|")
    for label, by_library in results.items():
        for library in libraries:
            if library not in by_library:
                print(f"| {label} | {library} | not in pytorch-ood 0.4 | | |")
                continue
            r = by_library[library]
            if "error" in r:
                print(f"| {label} | {library} | {_cell(r, '', 0)} | | |")
                continue
            rate = f"{r['samples_per_s']:,.0f}"
            if r.get("no_fit"):
                print(f"| {label} | {library} | no fit | no fit | {rate} |")
                continue
            print(f"| {label} | {library} | {_cell(r, 'growth_mib', 1)} | {_cell(r, 'seconds', 2)} | {rate} |")


if __name__ == "__main__":
    main()
