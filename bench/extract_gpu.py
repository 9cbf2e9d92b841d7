#!/usr/bin/env python
"""GPU benchmark of the extraction engine and of streaming detector fits from the feature store.

One command, from the repository root::

    python bench/extract_gpu.py                      # full run on a CUDA GPU (about 3-8 min on an H200)
    python bench/extract_gpu.py --quick              # tiny sizes; also runs on a CPU (smoke test)
    python bench/extract_gpu.py --n 200000           # smaller fit store (less disk, faster)
    python bench/extract_gpu.py --out bench/results/extract_gpu.md   # also write the table

Without CUDA (and without ``--quick``) it prints why and exits 0.

What it measures (targets in brackets):

(a) ResNet-50 (torchvision, random weights) at batch 256 with bf16 autocast and channels-last:
    ``oodviz.engine.extract`` over an in-memory dataset of uint8 images already 224 x 224 (so
    decoding is not the bottleneck), with DataLoader workers (``--workers``, default ``auto`` and 0), pinned memory and the store
    written to disk, against the bare forward pass on input already on the GPU, the limit
    [engine >= 90% of the limit]. The engine's rate is taken in steady state (from the 10th
    batch on); the whole-run rate, start-up included, is shown too.
(b) Peak GPU memory and time of fitting mahalanobis, rmd, vim (dim=1000), klm and she on
    1,281,167 x 2048 float32 features with C=1000 (ImageNet-1k train size), streamed from a
    feature store on disk to the GPU [< 1 GiB peak each]. The synthetic store takes about
    ``n * (D + C) * 4`` bytes: 15.6 GB at the default size; ``--n`` shrinks it, and it is
    shrunk automatically (with a note) when the disk has less than that free.
(c) Mahalanobis scoring throughput on the GPU at C=1000, D=2048 on features already on the GPU
    [>= 542,600 samples/s = 100 x pytorch-ood 0.4's 5,426], and from the store on disk for
    reference.
(d) Host memory: growth of this process's RSS while extracting 200,000 rows of D=2048, C=1000
    (2.4 GB store) with a cheap model [< 256 MiB, independent of N: rows go to disk as they come].
(e) knn (k=50) with the store of (b) as its bank (1,281,167 x 2048 at the default size, 9.8 GiB float32,
    normalised as it is read) against 50,000 queries on the GPU: one ``score`` call, its time and peak
    GPU memory [<= 60 s on one H200; with a smaller ``--n`` the time is also scaled to 1,281,167 rows].

The whole default run is the acceptance test of issue 13 at ImageNet scale: about 6-9 minutes on one H200
(the synthetic store, 15.6 GB, is written once and read by (b), (c) and (e)); ``--parts`` picks a subset.

Exit status 1 when a target is missed (rows marked FAIL, OVER or BELOW), else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oodviz import Batch
from oodviz.detectors import create
from oodviz.engine import StoreWriter, extract

GiB = 2**30


# ----------------------------------------------------------------------------- (a) extraction


class ImageNet(nn.Module):
    """A torchvision ResNet split into (features [B, 2048], logits [B, 1000]), normalising uint8 input on the device."""

    def __init__(self, arch: str):
        super().__init__()
        import torchvision

        self.net = getattr(torchvision.models, arch)(weights=None)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255)

    def forward(self, x):
        net = self.net
        x = (x.float() - self.mean) / self.std
        x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        x = net.layer4(net.layer3(net.layer2(net.layer1(x))))
        features = torch.flatten(net.avgpool(x), 1)
        return features, net.fc(features)


def identity(x):
    return x


class Backbone:
    """The engine's backbone contract around :class:`ImageNet`; input is already a uint8 tensor."""

    def __init__(self, arch: str):
        self.name = f"{arch}-random"
        self.weights_id = "random-init"
        self.model = ImageNet(arch)
        self.transform = identity

    def features_and_logits(self, x):
        return self.model(x)

    @property
    def head(self):
        fc = self.model.net.fc
        return fc.weight.detach(), fc.bias.detach()


class InMemoryImages:
    """``n`` items cycling over ``distinct`` random uint8 images ``[3, size, size]`` held in host memory."""

    def __init__(self, n: int, distinct: int, size: int, classes: int = 1000):
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 256, (distinct, 3, size, size), dtype=torch.uint8, generator=generator)
        self.n, self.distinct = n, distinct
        self.name = f"synthetic-uint8-{size}px"
        self.classes = [str(c) for c in range(classes)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.data[i % self.distinct], i % len(self.classes), i


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> int:
    """Start a fresh peak of the CUDA allocator; the bytes allocated now (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def bare_forward_rate(backbone, x, device, autocast_dtype, iters: int, warmup: int) -> float:
    """Images/s of the forward pass alone on ``x`` already on the device (the limit)."""
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype
        else torch.autocast(device.type, enabled=False)
    )
    with torch.inference_mode(), autocast:
        for _ in range(warmup):
            backbone.features_and_logits(x)
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            backbone.features_and_logits(x)
        sync(device)
    return iters * len(x) / (time.perf_counter() - start)


def part_a(args, device, rows, notes, scratch: Path):
    arch = "resnet18" if args.quick else "resnet50"
    size = 64 if args.quick else 224
    batch = args.batch_size
    precision = "bf16" if device.type == "cuda" else "fp32"
    autocast_dtype = torch.bfloat16 if precision == "bf16" else None
    channels_last = device.type == "cuda"
    torch.backends.cudnn.benchmark = True

    backbone = Backbone(arch)
    model = backbone.model.to(device).eval()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    dataset = InMemoryImages(args.images, distinct=min(args.images, 4 * batch), size=size)
    x = dataset.data[:batch].to(device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    limit = bare_forward_rate(backbone, x, device, autocast_dtype, iters=args.forward_iters, warmup=5)
    rows.append(
        (
            "a",
            f"{arch} bare forward, batch {batch}, {precision}, input on {device.type} (the limit)",
            f"{limit:,.0f} img/s",
            "",
            "",
        )
    )
    del x

    for workers in args.workers:
        marks = []

        def progress(done, total, info):
            marks.append((time.perf_counter(), done))  # noqa: B023

        root = scratch / f"extract-w{workers}"
        try:
            start = time.perf_counter()
            store = extract(
                backbone,
                dataset,
                root,
                {"bench": "a"},
                device=device,
                batch_size=batch,
                num_workers=workers,
                precision=precision,
                channels_last=channels_last,
                progress=progress,
                sync=False,
            )
            whole = dataset.n / (time.perf_counter() - start)
        except Exception as err:  # report and go on with the other parts
            rows.append(
                (
                    "a",
                    f"oodviz.engine.extract, {workers} workers",
                    f"failed: {type(err).__name__}: {err}"[:200],
                    ">= 90% of limit",
                    "FAIL",
                )
            )
            continue
        skip = min(10, max(1, len(marks) // 4))
        (t0, d0), (t1, d1) = marks[skip], marks[-2]  # [-1] is the "done" report after the commit
        steady = (d1 - d0) / (t1 - t0) if t1 > t0 else float("nan")
        ratio = steady / limit
        ok = "ok" if ratio >= 0.9 else "BELOW"
        rows.append(
            (
                "a",
                f"oodviz.engine.extract, {workers} workers{', pinned' if device.type == 'cuda' else ''}, {precision}, store to disk "
                f"({store.n:,} images; whole run {whole:,.0f} img/s)",
                f"{steady:,.0f} img/s = {ratio:.1%} of limit",
                ">= 90% of limit",
                ok if device.type == "cuda" else "n/a (CPU)",
            )
        )
        notes.append(
            f"(a) {workers} workers: batch size in force {store.meta['batch_size_in_force']}, first batch after {store.meta['timings']['first_batch_s']:.2f} s"
        )
        shutil.rmtree(root, ignore_errors=True)
    del backbone, model, dataset
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- (b) fits from the store


def make_store(root: Path, n: int, d: int, c: int, device, chunk: int = 65536):
    """A synthetic split of ``n`` rows: class means plus noise, logits from a head aimed at the class means;
    returns (store, seconds)."""
    generator = torch.Generator(device=device).manual_seed(0)
    means = torch.randn(c, d, device=device, generator=generator) * 0.5
    # a head that points at the class means (plus noise): most rows are classified right, as a trained one does
    weight = (means - means.mean(0)) / math.sqrt(d) + torch.randn(c, d, device=device, generator=generator) / d
    bias = torch.randn(c, device=device, generator=generator) * 0.1
    start = time.perf_counter()
    with StoreWriter(root, f"synthetic-n{n}-d{d}-c{c}", capacity=n, feature_dim=d, num_classes=c) as writer:
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            labels = torch.arange(s, e, device=device) % c
            features = (means[labels] + torch.randn(e - s, d, device=device, generator=generator)).relu_()
            logits = features @ weight.T + bias
            writer.append(features.cpu(), logits.cpu(), labels.cpu(), torch.arange(s, e), logits.argmax(1).cpu())
        store = writer.commit({"synthetic": True}, head=(weight.cpu(), bias.cpu()), sync=False)
    return store, time.perf_counter() - start


def part_b(args, device, rows, notes, scratch: Path):
    n, d, c = args.n, args.dim, args.classes
    need = n * (d + c) * 4 + n * 24
    free = shutil.disk_usage(scratch).free
    if need > 0.9 * free:
        shrunk = int(0.9 * free / ((d + c) * 4 + 24))
        notes.append(
            f"(b) only {free / GiB:.1f} GiB free under {scratch}: n shrunk from {n:,} to {shrunk:,} (store needs {need / GiB:.1f} GiB)"
        )
        n = shrunk
    store, seconds = make_store(scratch / "fit", n, d, c, device)
    gb = store.n * (d + c) * 4 / 1e9
    rows.append(
        (
            "b",
            f"synthetic store written: {store.n:,} x {d} features + {c} logits ({gb:.1f} GB) under {scratch}",
            f"{seconds:.1f} s",
            "",
            "",
        )
    )
    fitted = {}
    # Mahalanobis last: it is kept for (c); the others are dropped after their fit, so each fit
    # starts with (almost) nothing allocated on the GPU.
    fits = (("rmd", {}), ("vim", {"dim": min(1000, d // 2)}), ("klm", {}), ("she", {}), ("mahalanobis", {}))
    for name, params in fits:
        detector = create(name, **params)
        include = tuple(detector.inputs) + (("labels",) if detector.needs_labels else ())
        batches = store.batches(batch_size=args.fit_batch, device=device, include=include)
        # she needs the predictions: the head gives them from the features without reading the logits
        head = store.head if detector.needs_head or name == "she" else None
        base = reset_peak(device)
        sync(device)
        start = time.perf_counter()
        detector.fit(batches, head=head, device=device)
        sync(device)
        seconds = time.perf_counter() - start
        read_gb = (
            detector.fit_passes * store.n * sum({"features": d, "logits": c, "labels": 2}[f] for f in include) * 4 / 1e9
        )
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            reserved = torch.cuda.max_memory_reserved(device)
            value = f"{peak / 2**20:,.0f} MiB peak allocated ({reserved / 2**20:,.0f} MiB reserved), {seconds:.1f} s"
            ok = "ok" if peak < GiB else "OVER"
            if base:
                notes.append(
                    f"(b) {name}: {base / 2**20:.0f} MiB already allocated before the fit (counted in the peak)"
                )
        else:
            value, ok = f"{seconds:.1f} s (no GPU: memory not measured)", "n/a (CPU)"
        label = f"fit {name}{' (dim=' + str(params['dim']) + ')' if params else ''}, {detector.fit_passes} pass(es) over {read_gb:.1f} GB, disk -> {device.type}"
        rows.append(("b", label, value, "< 1 GiB peak", ok))
        if name == "mahalanobis":
            fitted[name] = detector
        del detector, batches
    return store, fitted


# ----------------------------------------------------------------------------- (c) scoring


def part_c(args, device, rows, store, fitted):
    detector = fitted["mahalanobis"]
    d = store.feature_dim
    n, batch = args.score_n, args.score_batch
    generator = torch.Generator(device=device).manual_seed(1)
    on_device = [
        Batch(features=torch.randn(min(batch, n - s), d, device=device, generator=generator))
        for s in range(0, n, batch)
    ]
    detector.score(on_device[:1], device=device)  # warm-up (kernels, workspace)
    sync(device)
    repeats = args.score_repeats
    start = time.perf_counter()
    for _ in range(repeats):
        scores = detector.score(on_device, device=device)
    sync(device)
    rate = repeats * n / (time.perf_counter() - start)
    ok = ("ok" if rate >= 542_600 else "BELOW") if device.type == "cuda" else "n/a (CPU)"
    rows.append(
        (
            "c",
            f"mahalanobis score, C={store.num_classes}, D={d}, features on {device.type}, batch {batch:,}",
            f"{rate:,.0f} samples/s",
            ">= 542,600/s",
            ok,
        )
    )
    if not torch.isfinite(scores).all():
        rows.append(("c", "mahalanobis scores finite", "NO", "all finite", "FAIL"))
    del on_device
    start = time.perf_counter()
    scores = detector.score(
        store.batches(batch_size=min(batch, 16384), device=device, include=("features",)), device=device
    )
    rate = store.n / (time.perf_counter() - start)
    rows.append(
        (
            "c",
            f"mahalanobis score from the store on disk ({store.n:,} rows, disk -> {device.type})",
            f"{rate:,.0f} samples/s",
            "(reference)",
            "",
        )
    )


# ----------------------------------------------------------------------------- (e) knn at scale

IMAGENET_ROWS = 1_281_167


def part_e(args, device, rows, store):
    """knn with the store as its bank (nothing written: the store's file is the bank) against queries on the device."""
    detector = create("knn", k=min(50, store.n))
    detector.fit(store.batches(batch_size=args.fit_batch, include=("features", "labels")))
    generator = torch.Generator(device=device).manual_seed(2)
    queries = torch.randn(args.knn_queries, store.feature_dim, device=device, generator=generator).relu_()
    base = reset_peak(device)
    sync(device)
    start = time.perf_counter()
    scores = detector.score(Batch(features=queries), device=device)
    sync(device)
    seconds = time.perf_counter() - start
    at_scale = seconds * IMAGENET_ROWS / store.n
    label = (
        f"knn score, k={detector.k}, bank {store.n:,} x {store.feature_dim} from the store, "
        f"{args.knn_queries:,} queries on {device.type}"
    )
    value = f"{seconds:.1f} s" + (
        f" (x {IMAGENET_ROWS:,} / {store.n:,} rows: {at_scale:.1f} s)" if store.n < IMAGENET_ROWS else ""
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
        value += f", {peak / GiB:.1f} GiB peak allocated"
        ok = "ok" if at_scale <= 60 else "OVER"
    else:
        ok = "n/a (CPU)"
    rows.append(("e", label, value, "<= 60 s at 1,281,167 rows", ok))
    if not torch.isfinite(scores).all():
        rows.append(("e", "knn scores finite", "NO", "all finite", "FAIL"))


# ----------------------------------------------------------------------------- (d) host memory


class Projection(nn.Module):
    """A cheap stand-in model: uint8 [B, 3, 8, 8] -> features [B, D] -> logits [B, C]."""

    def __init__(self, d: int, c: int):
        super().__init__()
        self.body = nn.Linear(3 * 8 * 8, d)
        self.fc = nn.Linear(d, c)

    def forward(self, x):
        features = self.body(x.flatten(1).float() / 255)
        return features, self.fc(features)


class CheapBackbone:
    def __init__(self, d: int, c: int):
        self.name, self.weights_id, self.model, self.transform = "projection", "random", Projection(d, c), identity
        self.head = None

    def features_and_logits(self, x):
        return self.model(x)


def part_d(args, device, rows, scratch: Path):
    import psutil

    n, d, c = args.memory_rows, 2048, 1000
    backbone = CheapBackbone(d, c)
    dataset = InMemoryImages(n, distinct=1024, size=8, classes=c)
    process = psutil.Process()
    base = process.memory_info().rss
    peak = [base]

    def progress(done, total, info):
        peak[0] = max(peak[0], process.memory_info().rss)

    start = time.perf_counter()
    store = extract(
        backbone,
        dataset,
        scratch / "memory",
        {"bench": "d"},
        device=device,
        batch_size=1024,
        progress=progress,
        sync=False,
    )
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in store.path.iterdir())
    growth = peak[0] - base
    ok = "ok" if growth < 256 * 2**20 else "OVER"
    rows.append(
        (
            "d",
            f"host RSS growth while extracting {store.n:,} rows (store {size / 2**20:,.0f} MiB on disk, {seconds:.1f} s)",
            f"{growth / 2**20:,.0f} MiB",
            "< 256 MiB, whatever N",
            ok,
        )
    )
    shutil.rmtree(store.path, ignore_errors=True)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU or GPU), a smoke test of this script")
    parser.add_argument(
        "--n", type=int, default=None, help="rows of the fit store in (b) (default 1,281,167; 20,000 with --quick)"
    )
    parser.add_argument("--dim", type=int, default=None, help="feature dimension D in (b)/(c) (default 2048)")
    parser.add_argument("--classes", type=int, default=None, help="classes C in (b)/(c) (default 1000)")
    parser.add_argument("--images", type=int, default=None, help="images extracted per run in (a) (default 256 x 150)")
    parser.add_argument("--batch-size", type=int, default=None, help="extraction batch size in (a) (default 256)")
    parser.add_argument(
        "--workers",
        nargs="+",
        default=None,
        help="DataLoader workers to try in (a): numbers or 'auto' (default: auto and 0)",
    )
    parser.add_argument("--fit-batch", type=int, default=4096, help="rows per batch streamed to the fits in (b)")
    parser.add_argument(
        "--store-dir", type=Path, default=None, help="where the synthetic stores go (default: a temporary directory)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the synthetic stores")
    parser.add_argument("--parts", default="abcde", help="which parts to run, e.g. 'bc'")
    parser.add_argument("--knn-queries", type=int, default=None, help="queries in (e) (default 50,000)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table (and a .json beside it)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print(
            "CUDA is not available here: skipping the GPU benchmark. Run `python bench/extract_gpu.py --quick` for a CPU smoke test."
        )
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    quick = args.quick
    args.n = args.n or (20_000 if quick else 1_281_167)
    args.dim = args.dim or (64 if quick else 2048)
    args.classes = args.classes or (10 if quick else 1000)
    args.batch_size = args.batch_size or (16 if quick else 256)
    args.images = args.images or (args.batch_size * (4 if quick else 150))
    workers = args.workers if args.workers is not None else ["auto", 0]
    args.workers = [w if w == "auto" else int(w) for w in workers]
    args.knn_queries = args.knn_queries or (500 if quick else 50_000)
    args.forward_iters = 3 if quick else 50
    args.score_n = 20_000 if quick else 262_144
    args.score_batch = 4096 if quick else 65536
    args.score_repeats = 2 if quick else 5
    args.memory_rows = 20_000 if quick else 200_000

    scratch = Path(tempfile.mkdtemp(prefix="oodviz-bench-", dir=args.store_dir))
    rows: list[tuple] = []
    notes: list[str] = []
    env = (
        f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if cuda else 'CPU only'}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {'--quick' if quick else 'full'} run"
    )
    print(f"oodviz extraction/store benchmark: {env}\nscratch: {scratch}", flush=True)
    started = time.perf_counter()
    try:
        if "a" in args.parts:
            part_a(args, device, rows, notes, scratch)
            print(f"(a) done after {time.perf_counter() - started:.0f} s", flush=True)
        if "d" in args.parts:
            part_d(args, device, rows, scratch)
            print(f"(d) done after {time.perf_counter() - started:.0f} s", flush=True)
        if set("bce") & set(args.parts):
            store, fitted = part_b(args, device, rows, notes, scratch)
            print(f"(b) done after {time.perf_counter() - started:.0f} s", flush=True)
            if "c" in args.parts:
                part_c(args, device, rows, store, fitted)
                print(f"(c) done after {time.perf_counter() - started:.0f} s", flush=True)
            if "e" in args.parts:
                part_e(args, device, rows, store)
                print(f"(e) done after {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    lines = [
        f"Environment: {env}; total {time.perf_counter() - started:.0f} s",
        "",
        "| part | measurement | value | target | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {' | '.join(str(c) for c in row)} |" for row in rows]
    if notes:
        lines += [""] + [f"- {note}" for note in notes]
    table = "\n".join(lines)
    print()
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
        args.out.with_suffix(".json").write_text(
            json.dumps({"environment": env, "rows": rows, "notes": notes}, indent=2)
        )
    failed = [r for r in rows if r[4] in ("FAIL", "OVER", "BELOW")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
