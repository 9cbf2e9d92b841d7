"""How far float32 kernels move the bundled CNN's features and a detector's scores: the figures behind the
tolerance in tests/kernels.py (issue 32).

The same images through the same weights give other float32 bits when PyTorch picks other kernels: another batch
size (oneDNN chooses convolution kernels by shape), another thread count, another instruction set (AVX-512 or AVX2,
i.e. another CPU), oneDNN on or off. This script extracts the digits test set (360 images) at three layers of the
bundled digits-cnn under each such variant, each in a fresh process with the variant's environment, and compares
with the reference (this machine's defaults, batch 256):

- features and logits: ``max |a - b| / max |b|`` over the array (the tolerance's form);
- knn's score (the distance of unit vectors to the k-th neighbour in the ID fit bank, itself extracted under the
  same variant): ``max |d_a^2 - d_b^2|``, the square ``2 - 2 cos`` being a difference of unit-vector products
  whose rounding does not grow as the distance shrinks (the distance's own relative error does: ``/ d^2``).

Run (about a minute on 2 cores)::

    .venv/bin/python bench/kernel_rounding.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

LAYERS = {"features.1": "avg", "features.4": "max", "penultimate": "avg"}
#: name -> (environment, batch size); the reference first
VARIANTS: dict[str, tuple[dict[str, str], int]] = {
    "reference (batch 256)": ({}, 256),
    "batch 37": ({}, 37),
    "batch 1": ({}, 1),
    "1 thread": ({"OMP_NUM_THREADS": "1"}, 256),
    "AVX2 (ATen, oneDNN, MKL)": (
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
        256,
    ),
    "no vector ISA (ATen default, oneDNN SSE4.1)": (
        {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
        256,
    ),
    "oneDNN off": ({"OODVIZ_TEST_ONEDNN": "off"}, 256),
    "oneDNN off, 1 thread, batch 37": ({"OODVIZ_TEST_ONEDNN": "off", "OMP_NUM_THREADS": "1"}, 37),
}
SITECUSTOMIZE_DIR = Path(__file__).resolve().parent.parent / "tests" / "kernel_variant"


def extract_variant(out: Path, batch_size: int) -> None:
    """In this process: each layer's features and logits of digits-test and digits-train (knn's bank) as .npy
    files under ``out``, and knn's scores (k=5) of the test images against the train bank."""
    import torch

    from oodviz import Batch
    from oodviz.config.run import RunConfig
    from oodviz.data import load_dataset
    from oodviz.detectors import create
    from oodviz.engine import extract

    backbone = RunConfig().load_backbone()
    figures = {"threads": torch.get_num_threads(), "mkldnn": torch.backends.mkldnn.enabled}
    figures["isa"] = torch.backends.cpu.get_cpu_capability()
    for layer, pooling in LAYERS.items():
        view = backbone if layer == "penultimate" else backbone.with_layer(layer, pooling)
        arrays = {}
        for split in ("digits-train", "digits-test"):
            store = extract(view, load_dataset(split), out / "stores" / layer, {"split": split}, batch_size=batch_size)
            arrays[split] = np.array(store.features)  # a writable copy for torch.from_numpy
            np.save(out / f"{layer}-{split}-features.npy", arrays[split])
            np.save(out / f"{layer}-{split}-logits.npy", np.asarray(store.logits))
        knn = create("knn", k=5).fit(Batch(features=torch.from_numpy(arrays["digits-train"])))
        np.save(out / f"{layer}-knn.npy", knn.score(Batch(features=torch.from_numpy(arrays["digits-test"]))).numpy())
    (out / "figures.json").write_text(json.dumps(figures))


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant-out", type=Path, help=argparse.SUPPRESS)  # the child's side
    parser.add_argument("--batch-size", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant_out:
        extract_variant(args.variant_out, args.batch_size)
        return
    with tempfile.TemporaryDirectory() as tmp:
        outs = {}
        for i, (name, (env, batch_size)) in enumerate(VARIANTS.items()):
            outs[name] = Path(tmp) / str(i)
            outs[name].mkdir()
            environment = {**os.environ, **env, "PYTHONPATH": str(SITECUSTOMIZE_DIR)}
            command = [sys.executable, __file__, "--variant-out", str(outs[name]), "--batch-size", str(batch_size)]
            subprocess.run(command, env=environment, check=True)
        reference = outs[next(iter(VARIANTS))]
        print("| variant | threads, ISA, oneDNN | layer | features | logits | knn d^2 (absolute) |")
        print("|---|---|---|---|---|---|")
        for name, out in outs.items():
            figures = json.loads((out / "figures.json").read_text())
            setting = f"{figures['threads']}, {figures['isa']}, {'on' if figures['mkldnn'] else 'off'}"
            for layer in LAYERS:
                cells = [
                    relative(
                        np.load(out / f"{layer}-digits-test-{kind}.npy"),
                        np.load(reference / f"{layer}-digits-test-{kind}.npy"),
                    )
                    for kind in ("features", "logits")
                ]
                mine, theirs = (np.load(o / f"{layer}-knn.npy").astype(np.float64) ** 2 for o in (out, reference))
                cells.append(float(np.abs(mine - theirs).max()))
                print(f"| {name} | {setting} | {layer} | " + " | ".join(f"{c:.2e}" for c in cells) + " |")


if __name__ == "__main__":
    main()
