"""Several layers in one pass (issue 17.3) against one extraction per layer.

For a backbone and a generated OOD set (``noise-gaussian``), extracts the given layers into a fresh feature
store root twice: once with :func:`oodviz.engine.layers.extract_layers_or_reuse` (one forward pass, one store
per layer) and once with :func:`oodviz.engine.extract_or_reuse` per layer (one forward pass each). Prints wall
time, the bytes written and whether the stores are equal (they must be: same keys, same arrays).

    python bench/layers.py --backbone digits-cnn --layers features.1 features.4 penultimate --n 20000
    python bench/layers.py --backbone resnet18 --weights random --layers layer2 layer3 penultimate --n 2000 --size 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from oodviz.columns import PENULTIMATE
from oodviz.data import load_dataset
from oodviz.engine import extract_or_reuse
from oodviz.engine.layers import extract_layers_or_reuse
from oodviz.models import load_backbone


def store_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="digits-cnn")
    parser.add_argument("--weights", default="default")
    parser.add_argument("--layers", nargs="+", default=["features.1", "features.4", PENULTIMATE])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--size", type=int, default=None, help="image size of the noise set (default: its own)")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    backbone = load_backbone(args.backbone, weights=args.weights)
    views = {name: backbone.with_layer(None if name == PENULTIMATE else name) for name in args.layers}
    params = {"n": args.n, **({"size": args.size} if args.size else {})}
    dataset = load_dataset("noise-gaussian", as_ood=True, **params)
    options = {"batch_size": args.batch_size, "sync": False}
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as each:
        started = time.perf_counter()
        together = extract_layers_or_reuse(views, dataset, Path(one), params, **options)
        one_s = time.perf_counter() - started
        started = time.perf_counter()
        apart = {name: extract_or_reuse(view, dataset, Path(each), params, **options) for name, view in views.items()}
        each_s = time.perf_counter() - started
        equal = all(
            together[name].key == apart[name].key
            and all(np.array_equal(getattr(together[name], a), getattr(apart[name], a)) for a in ("features", "logits"))
            for name in views
        )
        result = {
            "backbone": args.backbone,
            "layers": {name: view.feature_dim for name, view in views.items()},
            "n": args.n,
            "torch_threads": torch.get_num_threads(),
            "one_pass_s": round(one_s, 2),
            "one_pass_per_layer_s": round(each_s, 2),
            "speedup": round(each_s / one_s, 2),
            "bytes_one_pass": store_bytes(Path(one)),
            "bytes_per_layer": store_bytes(Path(each)),
            "stores_equal": equal,
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
