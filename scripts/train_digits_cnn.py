"""Train the bundled ``digits-cnn`` backbone and write ``oodviz/weights/digits-cnn.{pt,json}``.

    python scripts/train_digits_cnn.py [--epochs 60] [--out-dir oodviz/weights]

Deterministic (fixed seed, one CPU thread, deterministic algorithms): a rerun on the same
software versions writes the same weights. Trains on the ``"train"`` split of the digits 0-7
(:func:`oodviz.models.digits.digits_arrays`, the data layer's ``digits-train``), prints and
records the accuracy on ``"test"`` (``digits-test``). Both use the pixels as the app serves them
(uint8 images, :func:`~oodviz.models.digits.as_served`), so the recorded accuracy is the app's.
Runs in well under a minute on a laptop CPU; needs no network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oodviz.models.digits import (
    DIGITS_CLASSES,
    DIGITS_MEAN,
    DIGITS_SPLIT_SEED,
    DIGITS_STD,
    DIGITS_TEST_SIZE,
    WEIGHTS_DIR,
    DigitsCNN,
    as_served,
    digits_arrays,
    normalize_digits,
)
from oodviz.models.training import train_classifier

SEED = 0


def shift(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random translation by -1..1 pixels per image (zero padding), ``x [B, 1, 8, 8]``."""
    padded = F.pad(x, (1, 1, 1, 1), value=float(-DIGITS_MEAN / DIGITS_STD))  # value of a blank pixel
    dy, dx = torch.randint(0, 3, (2, len(x)), generator=generator)
    return torch.stack([p[:, i : i + 8, j : j + 8] for p, i, j in zip(padded, dy.tolist(), dx.tolist())])


@torch.no_grad()
def accuracy(model: DigitsCNN, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out-dir", type=Path, default=WEIGHTS_DIR)
    args = parser.parse_args()

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(SEED)

    train, test = digits_arrays("train"), digits_arrays("test")
    x_train, y_train = normalize_digits(as_served(train.images)), torch.from_numpy(train.labels)
    x_test, y_test = normalize_digits(as_served(test.images)), torch.from_numpy(test.labels)
    measured = (as_served(train.images) / 16).mean(), (as_served(train.images) / 16).std()
    if not np.allclose(measured, (DIGITS_MEAN, DIGITS_STD), atol=1e-4):
        raise SystemExit(
            f"train-split mean/std {measured} differ from DIGITS_MEAN/DIGITS_STD in oodviz/models/digits.py"
        )

    model = DigitsCNN(len(DIGITS_CLASSES))

    def report(epoch: int, mean_loss: float) -> None:
        if (epoch + 1) % 10 == 0 or epoch == args.epochs - 1:
            print(f"epoch {epoch + 1:3d}  loss {mean_loss:.4f}  test acc {accuracy(model, x_test, y_test):.4f}")

    seconds = train_classifier(
        model,
        x_train,
        y_train,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=1e-4,
        augment=shift,
        generator=generator,
        on_epoch=report,
    )

    model.eval()
    train_acc, test_acc = accuracy(model, x_train, y_train), accuracy(model, x_test, y_test)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    weights = args.out_dir / "digits-cnn.pt"
    torch.save(model.state_dict(), weights)
    metadata = {
        "name": "digits-cnn",
        "classes": DIGITS_CLASSES,
        "held_out_classes": ["8", "9"],
        "test_accuracy": round(test_acc, 6),
        "test_correct": int(round(test_acc * len(x_test))),
        "train_accuracy": round(train_acc, 6),
        "n_train": len(x_train),
        "n_test": len(x_test),
        "split": (
            "sklearn load_digits, all 1797 samples split with train_test_split(test_size="
            f"{DIGITS_TEST_SIZE}, random_state={DIGITS_SPLIT_SEED}, stratify=labels); train/test keep classes 0-7 "
            "(= oodviz.data digits-train / digits-test)"
        ),
        "input": "[1, 8, 8] greyscale: uint8 pixel p -> x = p / 255 * 16 -> (x / 16 - mean) / std",
        "mean": DIGITS_MEAN,
        "std": DIGITS_STD,
        "architecture": "conv(1->16,3,p1)-ReLU-conv(16->32,3,p1)-ReLU-maxpool2-conv(32->64,3,p1)-ReLU-avgpool -> 64-d features -> Linear(64, 8)",
        "feature_dim": DigitsCNN.feature_dim,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "training": {
            "seed": SEED,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "optimizer": "AdamW(weight_decay=1e-4), OneCycleLR",
            "lr": args.lr,
            "augmentation": "random shift by -1..1 pixels",
            "threads": 1,
            "seconds": round(seconds, 1),
        },
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "file_bytes": weights.stat().st_size,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }
    (args.out_dir / "digits-cnn.json").write_text(json.dumps(metadata, indent=2) + "\n")
    print(
        f"test accuracy {test_acc:.4f} ({metadata['test_correct']}/{len(x_test)}), train {train_acc:.4f}, {seconds:.1f} s"
    )
    print(f"wrote {weights} ({metadata['file_bytes']:,} bytes) and {args.out_dir / 'digits-cnn.json'}")


if __name__ == "__main__":
    main()
