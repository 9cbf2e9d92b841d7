"""What a job costs right now: host memory, GPU memory and utilisation; and which GPUs a job can use.

Read in the worker process (which owns the CUDA context). ``device_facts`` is for the app
process: it asks NVML, never CUDA, so the Streamlit server never creates a CUDA context.

**Which GPU is ``cuda:N``.** NVML numbers GPUs by PCI bus id; CUDA numbers the GPUs it can see, after
``CUDA_VISIBLE_DEVICES``, in the order ``CUDA_DEVICE_ORDER`` names: ``PCI_BUS_ID``, or ``FASTEST_FIRST``
(CUDA's default: "the fastest device first, the order of the rest unspecified"). So NVML index ``i``
is not ``cuda:i`` in general. Here:

- jobs started from the app run with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless it is set
  (:func:`job_environment`), and ``device_facts`` lists the GPUs in the order such a job sees them;
- ``CUDA_VISIBLE_DEVICES`` is read as CUDA reads it: a comma-separated list of indices (in that order),
  ``GPU-<uuid>`` entries (any unique prefix of the UUID), or ``MIG-<uuid>`` entries (a MIG instance,
  looked up by NVML); the list ends at the first entry that names no device, a repeated device makes
  it empty, and an empty variable hides every GPU. Not handled: the legacy ``MIG-GPU-<uuid>/<gi>/<ci>``
  form (it ends the list, as an unknown entry);
- with ``CUDA_DEVICE_ORDER=FASTEST_FIRST`` set explicitly and GPUs of different models, CUDA's choice
  of the fastest is a heuristic it does not document: the GPU of the highest compute capability (then
  the most memory) is listed first and the rest in PCI order, a guess. GPUs of one model are in PCI order;
- the worker maps its ``torch.device`` to the NVML handle by the device's UUID (PCI bus id as a
  fallback), never by index.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    import torch

MiB = 2**20


def cpu_rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or None where there is no such file or field."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int | None:
    """The kernel's high-water mark of this process's resident memory (``VmHWM``), or None off Linux."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (writing ``5`` to ``/proc/self/clear_refs``); False where that is not
    permitted or not Linux (then only sampled RSS is known)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return peak_rss_bytes() is not None


def job_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` for a job process: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless set, so that its ``cuda:N``
    is the N-th GPU of :func:`device_facts`."""
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **environ}


def memory_snapshot(device: torch.device | None) -> dict:
    """``cpu_rss`` and, on CUDA, ``gpu_allocated``/``gpu_reserved``/``gpu_peak``/``gpu_total`` (bytes) and
    ``gpu_util`` (percent, where NVML is available). Imports torch only here: the app's form lists devices
    (:func:`device_facts`) without it."""
    import torch

    snapshot = {"cpu_rss": cpu_rss_bytes()}
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        snapshot.update(
            gpu_allocated=torch.cuda.memory_allocated(index),
            gpu_reserved=torch.cuda.memory_reserved(index),
            gpu_peak=torch.cuda.max_memory_allocated(index),
            gpu_total=properties.total_memory,
        )
        pci = (properties.pci_domain_id, properties.pci_bus_id, properties.pci_device_id)
        util = _nvml_utilisation(str(properties.uuid), pci)
        if util is not None:
            snapshot["gpu_util"] = util
    return snapshot


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU: NVML raises its own error classes
        return None
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _uuid_key(uuid: str) -> str:
    """A UUID without its ``GPU-``/``MIG-`` prefix, lower case: NVML writes ``GPU-3f2a...``, torch ``3f2a...``."""
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        uuid = uuid.removeprefix(prefix)
    return uuid


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML sees it: its handle, ``GPU-<uuid>``, PCI ``(domain, bus, device)``, name."""

    handle: Any
    uuid: str
    pci: tuple[int, int, int]
    name: str


def nvml_gpus(nvml) -> list[NvmlGpu]:
    """Every GPU NVML sees, in NVML's (PCI bus id) order."""
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        pci = nvml.nvmlDeviceGetPciInfo(handle)
        gpus.append(
            NvmlGpu(
                handle,
                _text(nvml.nvmlDeviceGetUUID(handle)),
                (pci.domain, pci.bus, pci.device),
                _text(nvml.nvmlDeviceGetName(handle)),
            )
        )
    return gpus


def cuda_order(nvml, gpus: list[NvmlGpu], device_order: str) -> list[NvmlGpu]:
    """``gpus`` in the order CUDA numbers them under ``CUDA_DEVICE_ORDER=device_order`` (see the module docstring)."""
    by_bus = sorted(gpus, key=lambda gpu: gpu.pci)
    if device_order == "PCI_BUS_ID" or len({gpu.name for gpu in gpus}) <= 1:
        return by_bus

    def speed(gpu: NvmlGpu) -> tuple:
        try:
            capability = tuple(nvml.nvmlDeviceGetCudaComputeCapability(gpu.handle))
        except Exception:
            capability = (0, 0)
        return capability, int(nvml.nvmlDeviceGetMemoryInfo(gpu.handle).total)

    fastest = max(by_bus, key=speed)  # the first of equals: max keeps the earliest
    return [fastest] + [gpu for gpu in by_bus if gpu is not fastest]


def _leading_integer(entry: str) -> int | None:
    """The integer an entry of ``CUDA_VISIBLE_DEVICES`` starts with (CUDA reads ``"1gpu"`` as 1), or None."""
    digits = len(entry) - len(entry.lstrip("0123456789"))
    return int(entry[:digits]) if digits else None


def visible_gpus(nvml, environ: dict[str, str]) -> list[NvmlGpu]:
    """The GPUs a CUDA process with ``environ`` numbers ``cuda:0``, ``cuda:1``, ... (a MIG instance has no PCI id: -1s)."""
    ordered = cuda_order(nvml, nvml_gpus(nvml), environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ordered
    chosen: list[NvmlGpu] = []
    for entry in visible.split(","):
        entry = entry.strip()
        found = None
        if entry.upper().startswith("GPU-"):
            matches = [gpu for gpu in ordered if _uuid_key(gpu.uuid).startswith(_uuid_key(entry))]
            found = matches[0] if len(matches) == 1 else None  # CUDA takes a prefix only when it is unique
        elif entry.upper().startswith("MIG-"):
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(entry.encode())
                found = NvmlGpu(handle, entry, (-1, -1, -1), _text(nvml.nvmlDeviceGetName(handle)))
            except Exception:
                found = None
        elif (index := _leading_integer(entry)) is not None and index < len(ordered):
            found = ordered[index]
        if found is None:  # CUDA stops at the first entry that names no device
            break
        if any(_uuid_key(gpu.uuid) == _uuid_key(found.uuid) for gpu in chosen):
            return []  # CUDA hides every GPU when one is named twice
        chosen.append(found)
    return chosen


def nvml_handle(nvml, uuid: str, pci: tuple[int, int, int]):
    """The NVML handle of the GPU whose UUID is ``uuid`` (as torch writes it), else whose PCI
    ``(domain, bus, device)`` is ``pci``; None if NVML knows neither."""
    gpus = nvml_gpus(nvml)
    for gpu in gpus:
        if uuid and _uuid_key(gpu.uuid) == _uuid_key(uuid):
            return gpu.handle
    for gpu in gpus:
        if gpu.pci == tuple(pci):
            return gpu.handle
    return None


def _nvml_utilisation(uuid: str, pci: tuple[int, int, int]) -> float | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = nvml_handle(nvml, uuid, pci)
        return None if handle is None else float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # a MIG instance or an old driver: no utilisation to report
        return None


def device_facts(environ: dict[str, str] | None = None) -> list[dict]:
    """Devices a job started with ``job_environment(environ)`` (default: this process's) can use, without
    initialising CUDA: CPU first, then the GPUs it numbers ``cuda:0``, ``cuda:1``, ... (see the module docstring).

    Each entry: ``{"device": "cpu" | "cuda:N", "name", "total" (bytes), "free" (bytes)}``.
    """
    facts = [
        {
            "device": "cpu",
            "name": f"CPU ({psutil.cpu_count()} cores)",
            "total": psutil.virtual_memory().total,
            "free": psutil.virtual_memory().available,
        }
    ]
    nvml = _nvml()
    if nvml is None:
        return facts
    try:
        gpus = visible_gpus(nvml, job_environment(dict(os.environ) if environ is None else environ))
        for i, gpu in enumerate(gpus):
            memory = nvml.nvmlDeviceGetMemoryInfo(gpu.handle)
            facts.append(
                {"device": f"cuda:{i}", "name": gpu.name, "total": int(memory.total), "free": int(memory.free)}
            )
    except Exception:  # a driver that answers partly: offer the CPU rather than fail the page
        pass
    return facts
