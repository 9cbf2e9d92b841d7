"""Train the bundled ``fashion-cnn`` backbone and write ``oodviz/weights/fashion-cnn.{pt,json}``.

    python scripts/train_fashion_cnn.py [--epochs 10] [--threads 1] [--data-root data] [--out-dir oodviz/weights]

Trains on the 48,000 training images of the 8 ID classes of Fashion-MNIST (the data layer's
``fashion-mnist-id``, split ``train``; Shirt and Ankle boot held out), prints and records the
accuracy on the 8,000 ID test images (``fashion-mnist-id``, split ``test``) and on the uint8
pixels the app serves, so the recorded accuracy is the app's. The files are found as by the
app: ``<data root>/FashionMNIST/raw/``, else Debian's ``dataset-fashion-mnist``
(``apt-get install dataset-fashion-mnist``), else downloaded with ``--download``.

Deterministic (fixed seed, deterministic algorithms, one thread by default): a rerun with the same
thread count and software versions writes the same weights. Needs no network; takes about 5 to 9
minutes on a 2-core machine (499 s recorded for the bundled weights, on a machine shared with other jobs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oodviz.data.fashion import FASHION_CLASSES as ALL_CLASSES
from oodviz.data.fashion import FASHION_HELD_OUT, FASHION_ID_NAMES, fashion_split
from oodviz.models.fashion import (
    FASHION_CLASSES,
    FASHION_MEAN,
    FASHION_STD,
    WEIGHTS_DIR,
    FashionCNN,
    normalize_fashion,
)
from oodviz.models.training import train_classifier

SEED = 0
SHIFT = 2  # pixels


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random horizontal flip and translation by -2..2 pixels (blank padding), ``x [B, 1, 28, 28]``."""
    flip = torch.rand(len(x), generator=generator) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    padded = F.pad(x, (SHIFT,) * 4, value=float(-FASHION_MEAN / FASHION_STD))  # the value of a black pixel
    dy, dx = torch.randint(0, 2 * SHIFT + 1, (2, len(x)), generator=generator)
    out = torch.empty_like(x)
    for i in range(2 * SHIFT + 1):
        for j in range(2 * SHIFT + 1):
            rows = torch.nonzero((dy == i) & (dx == j)).flatten()
            if len(rows):
                out[rows] = padded[rows, :, i : i + 28, j : j + 28]
    return out


@torch.no_grad()
def predict(model: FashionCNN, x: torch.Tensor, batch: int = 2000) -> torch.Tensor:
    model.eval()
    return torch.cat([model(x[i : i + batch]).argmax(1) for i in range(0, len(x), batch)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: deterministic, and robust on a busy machine)",
    )
    parser.add_argument("--data-root", default="data", help="data root holding FashionMNIST/raw/ (default ./data)")
    parser.add_argument("--download", action="store_true", help="let torchvision download Fashion-MNIST if needed")
    parser.add_argument("--out-dir", type=Path, default=WEIGHTS_DIR)
    args = parser.parse_args()
    if FASHION_CLASSES != FASHION_ID_NAMES:
        raise SystemExit(f"model classes {FASHION_CLASSES} differ from the data layer's {FASHION_ID_NAMES}")

    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(SEED)

    train_images, train_labels, _ = fashion_split("train", args.data_root, args.download)
    test_images, test_labels, _ = fashion_split("test", args.data_root, args.download)
    measured = (train_images / 255.0).mean(), (train_images / 255.0).std()
    if not np.allclose(measured, (FASHION_MEAN, FASHION_STD), atol=1e-4):
        raise SystemExit(f"train mean/std {measured} differ from FASHION_MEAN/FASHION_STD in oodviz/models/fashion.py")
    x_train, y_train = normalize_fashion(train_images.copy()), torch.from_numpy(train_labels.copy())
    x_test, y_test = normalize_fashion(test_images.copy()), torch.from_numpy(test_labels.copy())

    model = FashionCNN(len(FASHION_CLASSES))
    start = time.perf_counter()

    def report(epoch: int, mean_loss: float) -> None:
        test_acc = float((predict(model, x_test) == y_test).float().mean())
        elapsed = time.perf_counter() - start
        print(f"epoch {epoch + 1:3d}  loss {mean_loss:.4f}  test acc {test_acc:.4f}  {elapsed:.0f}s", flush=True)

    seconds = train_classifier(
        model,
        x_train,
        y_train,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=5e-4,
        augment=augment,
        generator=generator,
        on_epoch=report,
    )

    predictions = predict(model, x_test)
    train_acc = float((predict(model, x_train) == y_train).float().mean())
    test_acc = float((predictions == y_test).float().mean())
    per_class = {
        name: round(float((predictions[y_test == k] == k).float().mean()), 4) for k, name in enumerate(FASHION_CLASSES)
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    weights = args.out_dir / "fashion-cnn.pt"
    torch.save(model.state_dict(), weights)
    metadata = {
        "name": "fashion-cnn",
        "classes": FASHION_CLASSES,
        "held_out_classes": [ALL_CLASSES[c] for c in FASHION_HELD_OUT],
        "test_accuracy": round(test_acc, 6),
        "test_correct": int((predictions == y_test).sum()),
        "test_accuracy_per_class": per_class,
        "train_accuracy": round(train_acc, 6),
        "n_train": len(x_train),
        "n_test": len(x_test),
        "split": (
            "Fashion-MNIST's own train (60,000) / test (10,000) split; classes 0-5, 7, 8 kept and relabelled 0..7, "
            "6 (Shirt) and 9 (Ankle boot) held out (= oodviz.data fashion-mnist-id / fashion-mnist-heldout)"
        ),
        "input": "[1, 28, 28] greyscale: uint8 pixel p -> (p / 255 - mean) / std",
        "mean": FASHION_MEAN,
        "std": FASHION_STD,
        "architecture": (
            "[conv3x3(1->16)-BN-ReLU]-maxpool2-[conv3x3(16->32)-BN-ReLU]-maxpool2-[conv3x3(32->64)-BN-ReLU]-"
            "[conv3x3(64->128)-BN-ReLU]-avgpool -> 128-d features -> Linear(128, 8)"
        ),
        "feature_dim": FashionCNN.feature_dim,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "training": {
            "seed": SEED,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "optimizer": "AdamW(weight_decay=5e-4), OneCycleLR",
            "lr": args.lr,
            "augmentation": f"random horizontal flip, random shift by -{SHIFT}..{SHIFT} pixels",
            "threads": args.threads,
            "seconds": round(seconds, 1),
        },
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "file_bytes": weights.stat().st_size,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }
    (args.out_dir / "fashion-cnn.json").write_text(json.dumps(metadata, indent=2) + "\n")
    print(
        f"test accuracy {test_acc:.4f} ({metadata['test_correct']}/{len(x_test)}), train {train_acc:.4f}, {seconds:.1f} s"
    )
    print(f"wrote {weights} ({metadata['file_bytes']:,} bytes) and {args.out_dir / 'fashion-cnn.json'}")


if __name__ == "__main__":
    main()
