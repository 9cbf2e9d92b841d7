"""The CUDA paths that can be checked without a GPU: copies, device choice, NVML mapping, host syncs, precision.

Tensors on the ``meta`` device stand in for a GPU's (no data, any device type but the host's);
``TorchFunctionMode``s record what the code asks torch to do. No test fakes ``torch.cuda`` into a GPU.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import cuda, make_problem
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from oodviz import Batch
from oodviz.batch import non_blocking_copy
from oodviz.detectors import create
from oodviz.detectors.mcd import rng_device
from oodviz.runs.telemetry import device_facts, job_environment, nvml_handle

REPO = Path(__file__).resolve().parent.parent

CPU, META = torch.device("cpu"), torch.device("meta")


class CopyRecorder(TorchFunctionMode):
    """Records ``(source device, target device, non_blocking)`` of every ``Tensor.to`` / ``copy_``; a copy out of
    a meta tensor (which has no data) returns an empty tensor on the target instead of failing."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            source = args[0]
            target = next((a for a in args[1:] if isinstance(a, (torch.device, str))), kwargs.get("device"))
            target = source.device if target is None else torch.device(target)
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
            self.copies.append((source.device, target, non_blocking))
            if source.device.type == "meta" and target.type != "meta":
                return torch.empty(source.shape, dtype=source.dtype, device=target)
        elif func is torch.Tensor.copy_:
            target, source = args[0], args[1]
            self.copies.append(
                (source.device, target.device, kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            )
        return func(*args, **kwargs)


def meta_batch(n=5) -> Batch:
    return Batch(
        torch.empty(n, 4, device="meta"),
        torch.empty(n, 3, device="meta"),
        torch.empty(n, dtype=torch.long, device="meta"),
        torch.empty(n, 1, 2, 2, device="meta"),
    )


def test_device_to_host_copies_block():
    with CopyRecorder() as recorder:
        moved = meta_batch().to("cpu")
    assert [t.device.type for t in (moved.features, moved.logits, moved.labels, moved.inputs)] == ["cpu"] * 4
    assert len(recorder.copies) == 4
    assert all(
        source == META and target == CPU and not non_blocking for source, target, non_blocking in recorder.copies
    )


def test_pageable_host_to_device_copies_block():
    batch = Batch(torch.zeros(5, 4), torch.zeros(5, 3), torch.zeros(5, dtype=torch.long))
    assert not batch.features.is_pinned()
    with CopyRecorder() as recorder:
        moved = batch.to("meta")
    assert moved.device == META
    assert [c[2] for c in recorder.copies] == [False, False, False]


def test_only_pinned_host_to_device_copies_may_be_asynchronous():
    cuda0, cuda1 = torch.device("cuda:0"), torch.device("cuda:1")
    assert non_blocking_copy(CPU, True, cuda0)
    assert non_blocking_copy(CPU, True, META)
    assert not non_blocking_copy(CPU, False, cuda0)  # pageable: CUDA copies it synchronously anyway
    assert not non_blocking_copy(cuda0, False, CPU)  # the host would read the pages before the data lands
    assert not non_blocking_copy(cuda0, True, CPU)
    assert not non_blocking_copy(cuda0, False, cuda1)  # ordered on the source's stream only
    assert not non_blocking_copy(CPU, True, CPU)


def test_batch_on_the_target_device_is_not_copied():
    batch = meta_batch()
    with CopyRecorder() as recorder:
        assert batch.to("meta") is batch
    assert recorder.copies == []


# ----------------------------------------------------------------------------- which GPU is cuda:N


@dataclass
class FakeGpu:
    uuid: str
    bus: int
    name: str
    capability: tuple[int, int]
    total: int
    free: int
    utilisation: int = 0


class FakeNvml:
    """The pynvml calls oodviz makes, answered from a list of made-up GPUs (in NVML's order) and MIG instances."""

    def __init__(self, gpus: list[FakeGpu], migs: dict[str, FakeGpu] | None = None):
        self.gpus, self.migs = gpus, migs or {}

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return self.migs[uuid.decode()]  # KeyError: NVML's "not found"

    def nvmlDeviceGetUUID(self, gpu):
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu):
        return gpu.name.encode()  # older pynvml returns bytes

    def nvmlDeviceGetPciInfo(self, gpu):
        return SimpleNamespace(domain=0, bus=gpu.bus, device=0, busId=f"00000000:{gpu.bus:02X}:00.0")

    def nvmlDeviceGetCudaComputeCapability(self, gpu):
        return gpu.capability

    def nvmlDeviceGetMemoryInfo(self, gpu):
        return SimpleNamespace(total=gpu.total, free=gpu.free, used=gpu.total - gpu.free)

    def nvmlDeviceGetUtilizationRates(self, gpu):
        return SimpleNamespace(gpu=gpu.utilisation, memory=0)


GiB = 2**30
A10_FIRST = FakeGpu("GPU-aaaa1111-0000-0000-0000-000000000000", 0x1A, "NVIDIA A10", (8, 6), 24 * GiB, 20 * GiB, 11)
H100 = FakeGpu("GPU-bbbb2222-0000-0000-0000-000000000000", 0x3B, "NVIDIA H100", (9, 0), 80 * GiB, 70 * GiB, 22)
A10_LAST = FakeGpu("GPU-aaab3333-0000-0000-0000-000000000000", 0x5E, "NVIDIA A10", (8, 6), 24 * GiB, 10 * GiB, 33)
MIG = FakeGpu("MIG-cccc4444-0000-0000-0000-000000000000", 0x3B, "NVIDIA H100 MIG 1g.10gb", (9, 0), 10 * GiB, 9 * GiB)


@pytest.fixture
def fake_nvml(monkeypatch):
    # NVML lists by PCI bus id; this one does not, so that the tests see the ordering is oodviz's own.
    nvml = FakeNvml([H100, A10_LAST, A10_FIRST], {MIG.uuid: MIG})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, [A10_FIRST, H100, A10_LAST]),  # jobs run with CUDA_DEVICE_ORDER=PCI_BUS_ID
        ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, [A10_FIRST, H100, A10_LAST]),
        ({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, [H100, A10_FIRST, A10_LAST]),  # the guess: highest capability
        ({"CUDA_DEVICE_ORDER": "FASTEST_FIRST", "CUDA_VISIBLE_DEVICES": "0"}, [H100]),
        ({"CUDA_VISIBLE_DEVICES": "2,0"}, [A10_LAST, A10_FIRST]),
        ({"CUDA_VISIBLE_DEVICES": " 1 , 2"}, [H100, A10_LAST]),
        ({"CUDA_VISIBLE_DEVICES": "1gpu,0"}, [H100, A10_FIRST]),  # read like strtoul
        ({"CUDA_VISIBLE_DEVICES": "1,7,0"}, [H100]),  # the list ends at a device that does not exist
        ({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, [H100]),
        ({"CUDA_VISIBLE_DEVICES": "0,2,0"}, []),  # a repeat hides every GPU
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
        ({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}, [H100]),  # a unique UUID prefix
        ({"CUDA_VISIBLE_DEVICES": "GPU-aaab3333,0"}, [A10_LAST, A10_FIRST]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-aaa,1"}, []),  # an ambiguous prefix names no device
        ({"CUDA_VISIBLE_DEVICES": f"{H100.uuid},{H100.uuid}"}, []),
        ({"CUDA_VISIBLE_DEVICES": f"{MIG.uuid}"}, [MIG]),
        ({"CUDA_VISIBLE_DEVICES": "MIG-dddd"}, []),
    ],
)
def test_device_facts_list_the_gpus_a_job_numbers_cuda_0_to_n(fake_nvml, environ, expected):
    facts = device_facts(environ)
    assert facts[0]["device"] == "cpu"
    assert [(f["device"], f["name"], f["total"], f["free"]) for f in facts[1:]] == [
        (f"cuda:{i}", gpu.name, gpu.total, gpu.free) for i, gpu in enumerate(expected)
    ]


def test_a_job_gets_pci_bus_order_unless_its_environment_names_one():
    assert job_environment({"PATH": "/bin"}) == {"PATH": "/bin", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert job_environment({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_the_worker_finds_its_gpu_by_uuid_then_by_pci_bus_id(fake_nvml):
    # torch writes the UUID without the "GPU-" prefix; PCI is (domain, bus, device)
    assert nvml_handle(fake_nvml, A10_LAST.uuid.removeprefix("GPU-"), (0, 0x1A, 0)) is A10_LAST  # the UUID wins
    assert nvml_handle(fake_nvml, "", (0, 0x3B, 0)) is H100
    assert nvml_handle(fake_nvml, "eeee5555-0000-0000-0000-000000000000", (0, 0x99, 0)) is None


def test_no_nvml_lists_the_cpu_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert [f["device"] for f in device_facts({})] == ["cpu"]


CONTEXT_ENTRY_POINTS = (
    "init",
    "_lazy_init",
    "is_available",
    "device_count",
    "current_device",
    "set_device",
    "synchronize",
    "mem_get_info",
    "get_device_properties",
    "get_device_name",
    "get_device_capability",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
)


@pytest.fixture
def cuda_tripwire(monkeypatch):
    """Every ``torch.cuda`` entry point that creates (or asks about) a CUDA context raises while the test runs."""
    touched = []

    def tripwire(name):
        def wire(*args, **kwargs):
            touched.append(name)
            raise AssertionError(f"the app process called torch.cuda.{name}")

        return wire

    for name in CONTEXT_ENTRY_POINTS:
        monkeypatch.setattr(torch.cuda, name, tripwire(name))
    monkeypatch.setattr(torch._C, "_cuda_init", tripwire("_C._cuda_init"), raising=False)
    return touched


def test_listing_devices_in_the_app_never_touches_cuda(fake_nvml, cuda_tripwire, tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from oodviz.ui.new_run import _devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert [f["device"] for f in device_facts()] == ["cpu", "cuda:0", "cuda:1", "cuda:2"]
    _devices.clear()  # Streamlit's cache: this test's fake GPUs must neither come from nor stay in it
    try:
        assert [f["name"] for f in _devices()][1:] == [A10_FIRST.name, H100.name, A10_LAST.name]
        monkeypatch.setenv("OODVIZ_RUNS_ROOT", str(tmp_path))
        app = AppTest.from_file(str(REPO / "app.py"), default_timeout=60).run()
    finally:
        _devices.clear()
    assert not app.exception
    device_box = [s for s in app.selectbox if s.label.lower().startswith("device")][0]
    assert [o for o in device_box.options if "cuda" in o] and cuda_tripwire == []


# ----------------------------------------------------------------------------- odin under autocast, mcd's generator


def tiny_weights_model() -> nn.Module:
    """A linear classifier whose input gradient at T = 1000 is about |W| / T ~ 1e-8: zero in float16."""
    torch.manual_seed(0)
    model = nn.Linear(8, 5)
    with torch.no_grad():
        model.weight.mul_(1e-4)
    return model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_odin_under_autocast_steps_as_in_float32(dtype):
    model = tiny_weights_model()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    odin = create("odin", norm_std=None, model=model)
    # float64 reference of sign(-grad_x log S_yhat(x; T)): the gradient of the cross-entropy is W^T (p - onehot) / T
    w, b = model.weight.double(), model.bias.double()
    logits = (x.double() @ w.T + b) / odin.temperature
    p = logits.softmax(dim=1)
    expected_sign = ((p - F.one_hot(logits.argmax(dim=1), 5)) @ w / odin.temperature).sign()
    assert (expected_sign != 0).all()
    with torch.autocast("cpu", dtype=dtype):
        step = odin.perturb(x) - x
        scores = odin.score(Batch(inputs=x))
    torch.testing.assert_close(step.sign().double(), -expected_sign, rtol=0, atol=0)  # x' = x - eps * sign(grad)
    # the second forward runs in the caller's autocast; divided by T = 1000 its rounding stays below 1e-6
    torch.testing.assert_close(scores, odin.score(Batch(inputs=x)), rtol=0, atol=1e-6)


def test_mcd_draws_on_the_generator_of_the_device_the_model_runs_on():
    assert rng_device(nn.Linear(2, 2, device="meta"), CPU) == META  # where the parameters are, not what was asked
    assert rng_device(nn.Linear(2, 2), torch.device("cuda:1")) == CPU
    assert rng_device(nn.Dropout(0.5), torch.device("cuda:3")) == torch.device("cuda:3")  # no parameters: as asked
    assert rng_device(None, torch.device("cuda:2")) == torch.device("cuda:2")


def test_mcd_on_the_cpu_seeds_no_gpu_generator(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("mcd touched a CUDA generator while scoring on the CPU")

    for name in ("manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state", "get_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, tripwire)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    x = torch.randn(10, 6)
    first = create("mcd", model=model, samples=5, seed=2).score(Batch(inputs=x))
    torch.default_generator.manual_seed(123)
    state = torch.get_rng_state()
    again = create("mcd", model=model, samples=5, seed=2).score(Batch(inputs=x))
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------- host syncs per fit batch

#: what makes the host wait for a GPU (on the CPU they are only counted): a value read into Python, or an output
#: whose size depends on the data
SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero", "masked_select"}


class SyncCounter(TorchFunctionMode):
    """Counts the host syncs made from the lines of ``source`` (a path suffix), attributed to the first frame
    outside torch, so that the syncs of the caller's own code are told apart from those of the code it calls."""

    def __init__(self, source: str):
        super().__init__()
        self.source, self.count = source, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            frame = sys._getframe(1)
            while frame is not None and f"{Path(torch.__file__).parent}" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.endswith(self.source):
                self.count += 1
        return func(*args, **(kwargs or {}))


def vim_fit_syncs(n_batches: int) -> int:
    problem = make_problem(n_classes=10, dim=300, n_fit=200 * n_batches)
    batches = problem.fit_batches(size=200)  # one row block each (stats.row_blocks); the old code synced twice a block
    with SyncCounter("oodviz/detectors/vim.py") as counter:
        create("vim", dim=20).fit(batches, head=problem.head)
    return counter.count


def test_vim_fit_makes_no_host_sync_per_batch():
    """Budget: 0 syncs per batch in vim.py's own code (both passes accumulate on the device), at most 2 per fit
    (the two sums of the second pass, read once). FitData's reading of the batches is counted in its own test."""
    few, many = vim_fit_syncs(3), vim_fit_syncs(9)
    assert many == few
    assert few <= 2


# ----------------------------------------------------------------------------- out of memory, sticky errors, restore

#: messages as torch and the CUDA libraries word them, and what oodviz must do with each
CUDA_MESSAGES = [
    (
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 77.10 GiB already allocated)",
        "out_of_memory",
    ),
    (
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call",
        "out_of_memory",
    ),
    ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "out_of_memory"),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "out_of_memory"),
    ("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`", "out_of_memory"),
    ("cuFFT error: CUFFT_ALLOC_FAILED", "out_of_memory"),
    (
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported at "
        "some other API call, so the stacktrace below might be incorrect.",
        "sticky",
    ),
    (
        "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        "sticky",
    ),
    ("CUDA error: unspecified launch failure", "sticky"),
    ("CUDA error: misaligned address", "sticky"),
    ("CUDA error: an illegal instruction was encountered", "sticky"),
    ("CUDA error: the launch timed out and was terminated", "sticky"),
    ("CUDA error: uncorrectable ECC error encountered", "sticky"),
    ("CUDA error: invalid device ordinal", "other"),
    (
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
        "other",
    ),
    ("mat1 and mat2 shapes cannot be multiplied (8x512 and 256x10)", "other"),
]


@pytest.mark.parametrize(("message", "kind"), CUDA_MESSAGES)
def test_cuda_errors_are_told_apart_by_their_message(message, kind):
    from oodviz.engine.batched import cuda_error_kind, is_out_of_memory

    assert cuda_error_kind(RuntimeError(message)) == kind
    assert is_out_of_memory(RuntimeError(message)) == (kind == "out_of_memory")
    assert cuda_error_kind(ValueError(message)) == "other"  # only RuntimeErrors come from CUDA
    assert cuda_error_kind(torch.cuda.OutOfMemoryError("CUDA out of memory.")) == "out_of_memory"


def failing_submit(message: str, fails_above: int):
    """``submit(start, stop)`` that raises RuntimeError(message) for more than ``fails_above`` rows; records calls."""
    calls = []

    def submit(start, stop):
        calls.append((start, stop))
        if stop - start > fails_above:
            raise RuntimeError(message)
        return stop - start

    return submit, calls


@pytest.mark.parametrize("message", [m for m, kind in CUDA_MESSAGES if kind == "out_of_memory"])
def test_backoff_retries_every_allocation_failure_in_halves(message):
    from oodviz.engine.batched import Backoff

    backoff = Backoff(8, CPU, "testing")
    submit, calls = failing_submit(message, fails_above=2)
    assert [(a, b) for a, b, _ in backoff.chunks(8, submit)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert calls[:3] == [(0, 8), (0, 4), (0, 2)]
    assert backoff.in_force == 2 and backoff.backoffs == 2


@pytest.mark.parametrize("message", [m for m, kind in CUDA_MESSAGES if kind == "sticky"])
def test_backoff_never_retries_a_sticky_cuda_error(message):
    from oodviz.engine.batched import Backoff, CudaContextLost

    backoff = Backoff(8, CPU, "extracting features")
    submit, calls = failing_submit(message, fails_above=0)
    with pytest.raises(CudaContextLost, match="unusable while extracting features.*Restart the run") as raised:
        list(backoff.chunks(8, submit))
    assert calls == [(0, 8)]
    assert isinstance(raised.value.__cause__, RuntimeError) and str(raised.value.__cause__) == message
    assert message in str(raised.value)
    assert backoff.in_force == 8 and backoff.backoffs == 0


def test_backoff_passes_other_errors_through_untouched():
    from oodviz.engine.batched import Backoff

    error = ValueError("bad input")

    def submit(start, stop):
        raise error

    with pytest.raises(ValueError) as raised:
        list(Backoff(8, CPU, "testing").chunks(8, submit))
    assert raised.value is error


def test_a_failed_restore_does_not_hide_the_error_of_the_block(monkeypatch):
    from oodviz.models import placement

    model = nn.Linear(2, 2).train()
    original = RuntimeError("CUDA error: an illegal memory access was encountered")

    def restore(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (while restoring)")

    monkeypatch.setattr(placement._ModelState, "restore", restore)
    with pytest.raises(RuntimeError) as raised, placement.model_on_device(model, CPU):
        raise original
    assert raised.value is original
    assert any("could not put the model back" in note and "while restoring" in note for note in raised.value.__notes__)


def test_a_block_that_succeeds_still_restores_and_a_failed_restore_then_raises(monkeypatch):
    from oodviz.models import placement

    model = nn.Linear(2, 2).train()
    with placement.model_on_device(model, CPU):
        assert not model.training
    assert model.training  # put back

    def restore(self):
        raise RuntimeError("restore failed")

    monkeypatch.setattr(placement._ModelState, "restore", restore)
    with pytest.raises(RuntimeError, match="restore failed"), placement.model_on_device(model, CPU):
        pass


# ----------------------------------------------------------------------------- shared memory for the data loader

MIB = 2**20


@pytest.mark.parametrize(
    ("free_mib", "workers", "batch_mib", "factor", "note"),
    [
        (None, 8, 150, 4, None),  # no /dev/shm (not Linux): DataLoader's own limits
        (64_000, 8, 150, 4, None),  # a host's /dev/shm: 8 x 4 x 150 MiB = 4.7 GiB fits in half of it
        (2048, 2, 150, 3, "reading 3 batch(es) ahead per worker instead of 4"),  # 1024 // 300 = 3
        (64, 8, 150, 1, "too little for 8 workers x 150 MiB per batch"),  # Docker's default: even 1 does not fit
    ],
)
def test_prefetch_fits_in_the_free_shared_memory(free_mib, workers, batch_mib, factor, note):
    from oodviz.engine.batched import prefetch_factor

    free = None if free_mib is None else free_mib * MIB
    got, message = prefetch_factor(batch_mib * MIB, workers, free)
    assert got == factor
    assert (message is None) == (note is None)
    if note is not None:
        assert note in message and "--shm-size" in message


class Images:
    """A dataset of ``n`` float32 [3, 32, 32] images (12 KiB each)."""

    name = "images"

    def __init__(self, n=64):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 32, 32), float(i)), i % 3, i


def test_make_loader_sizes_prefetch_from_statvfs(monkeypatch, caplog):
    from oodviz.engine import batched

    block = 4096
    # 16 rows x 12 KiB = 192 KiB a batch, 2 workers: half of 1 MiB holds 2 batches in all -> 1 per worker
    monkeypatch.setattr(batched.os, "statvfs", lambda path: SimpleNamespace(f_bavail=MIB // block, f_frsize=block))
    with caplog.at_level("WARNING", logger="oodviz.engine"):
        loader, note = batched.make_loader(Images(), None, 16, 2, CPU)
    assert loader.prefetch_factor == 1
    assert "1 MiB free: reading 1 batch(es) ahead per worker instead of 4 (2 workers x 192 KiB per batch)" in note
    assert note in caplog.text
    monkeypatch.setattr(batched.os, "statvfs", lambda path: SimpleNamespace(f_bavail=2**30 // block, f_frsize=block))
    loader, note = batched.make_loader(Images(), None, 16, 2, CPU)
    assert loader.prefetch_factor == 4 and note is None
    loader, note = batched.make_loader(Images(), None, 16, 0, CPU)  # no workers: nothing in shared memory
    assert loader.prefetch_factor is None and note is None


def test_a_pass_short_of_shared_memory_says_so_in_every_progress_report(monkeypatch):
    from oodviz.engine import batched

    block = 4096
    monkeypatch.setattr(batched.os, "statvfs", lambda path: SimpleNamespace(f_bavail=MIB // block, f_frsize=block))
    reports, rows = [], []
    backbone = SimpleNamespace(model=None, transform=None)
    with batched.BatchedPass(
        backbone,
        Images(48),
        device=CPU,
        batch_size=16,
        num_workers=1,
        precision="fp32",
        activity="testing",
        stage="extract",
        progress=lambda done, total, info: reports.append(info),
    ) as run:
        run.run(lambda x, labels, indices: indices, rows.append)
    assert torch.equal(torch.cat(rows), torch.arange(48))
    assert len(reports) == 3
    assert all("reading 2 batch(es) ahead per worker" in info["note"] for info in reports)  # 512 KiB / 192 KiB


def fit_data_syncs(n_batches: int, passes: int) -> list[int]:
    """Host syncs made by fitdata.py (FitData) on each of ``passes`` passes over ``n_batches`` clean batches."""
    from oodviz.detectors.base import FitData

    problem = make_problem(n_fit=100 * n_batches)
    data = FitData(problem.fit_batches(size=100), None, create("tempscale"), problem.head)
    counts = []
    for _ in range(passes):
        with SyncCounter("oodviz/detectors/fitdata.py") as counter:
            rows = sum(len(batch) for batch in data)
        assert rows == 100 * n_batches
        counts.append(counter.count)
    return counts


def test_fit_data_reads_the_device_once_per_batch_on_the_first_pass_and_never_later():
    """Budget (FitData's docstring): 1 sync per batch on the validating pass (labels, OOD rows, finiteness of
    every field the detector reads: one flag vector read at once), 0 on later passes. The old code made 3-5 a batch
    on the first pass and 1 a batch on every later one."""
    assert fit_data_syncs(3, passes=3) == [3, 0, 0]
    assert fit_data_syncs(7, passes=2) == [7, 0]


def test_fit_data_drops_ood_rows_on_every_pass_from_what_the_first_pass_found():
    from oodviz.detectors.base import FitData

    problem = make_problem(n_fit=300)
    labels = problem.fit_y.clone()
    labels[250:] = -1  # the last batch is all OOD, the middle one part OOD, the first clean
    logits = problem.logits(problem.fit_x)
    batches = [Batch(problem.fit_x[i : i + 100], logits[i : i + 100], labels[i : i + 100]) for i in (0, 100, 200)]
    data = FitData(batches, None, create("tempscale"), problem.head)
    for _ in range(3):
        kept = list(data)
        assert [len(b) for b in kept] == [100, 100, 50]
        assert torch.equal(torch.cat([b.labels for b in kept]), labels[:250])
        assert torch.equal(torch.cat([b.features for b in kept]), problem.fit_x[:250])


def test_fit_data_still_catches_bad_values_with_its_one_read():
    from oodviz.detectors.base import FitData

    problem = make_problem(n_fit=200)
    logits = problem.logits(problem.fit_x)
    ood_nan = problem.fit_x.clone()
    ood_nan[5, 3] = float("nan")  # in an OOD row: dropped, so fine
    labels = problem.fit_y.clone()
    labels[5] = -1
    data = FitData([Batch(ood_nan, logits, labels)], None, create("knn"), problem.head)
    assert sum(len(b) for b in data) == 199
    huge = torch.full_like(problem.fit_x, 3e38)  # finite, but every row sum overflows: the closer look passes it
    assert sum(len(b) for b in FitData([Batch(huge, logits, problem.fit_y)], None, create("knn"), problem.head)) == 200
    in_distribution_nan = ood_nan.clone()
    in_distribution_nan[7, 0] = float("inf")
    with pytest.raises(ValueError, match="batch 0 has 1 sample"):
        list(FitData([Batch(in_distribution_nan, logits, labels)], None, create("knn"), problem.head))
    too_big = problem.fit_y.clone()
    too_big[3] = 6
    with pytest.raises(ValueError, match="has label 6 but the model has C=6 classes"):
        list(FitData([Batch(problem.fit_x, logits, too_big)], None, create("knn"), problem.head))
    too_small = problem.fit_y.clone()
    too_small[3] = -2
    with pytest.raises(ValueError, match=r"labels below -1 \(min -2\)"):
        list(FitData([Batch(problem.fit_x, logits, too_small)], None, create("knn"), problem.head))


def test_tempscale_reads_its_sums_once_per_pass():
    """Budget: 1 sync per pass in tempscale.py (the three float64 sums, accumulated on the device, read together),
    whatever the number of batches; the old code read 3 per batch."""
    problem = make_problem(n_fit=1200)
    counts = {}
    for size in (400, 100):
        detector = create("tempscale")
        with SyncCounter("oodviz/detectors/tempscale.py") as counter:
            detector.fit(problem.fit_batches(size=size))
        counts[size] = counter.count
    assert counts[100] == counts[400]
    assert 2 <= counts[100] <= 1 + 2 * detector.max_steps  # one per pass: the first, then 1-2 per Newton step


@cuda  # marked cuda by conftest's hook: selected by -m cuda
def test_a_cuda_stage_lasts_until_its_kernels_end(tmp_path):
    from oodviz.config.run import RunConfig
    from oodviz.pipeline.reporter import Reporter
    from oodviz.runs.rundir import RunDir

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda._sleep(1000)  # warm up (context, kernel load)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # ~0.1 s at 2 GHz: how long this GPU takes is measured, not assumed
    torch.cuda.synchronize(device)
    kernel_s = time.perf_counter() - start
    reporter = Reporter(RunDir.create(tmp_path, RunConfig().to_dict()))
    reporter.device = device
    with reporter.stage("sleep"):
        torch.cuda._sleep(200_000_000)  # queued: returns at once
    assert reporter.stage_summary()["sleep"]["wall_s"] >= 0.8 * kernel_s
