"""What a job costs right now: host memory, GPU memory and utilisation.

Read in the worker process (which owns the CUDA context). ``device_facts`` is for the app
process: it asks NVML, never CUDA, so the Streamlit server never creates a CUDA context.
"""

from __future__ import annotations

import os

import psutil
import torch

MiB = 2**20


def cpu_rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def memory_snapshot(device: torch.device | None) -> dict:
    """``cpu_rss`` and, on CUDA, ``gpu_allocated``/``gpu_reserved``/``gpu_peak``/``gpu_total`` (bytes) and
    ``gpu_util`` (percent, where NVML is available)."""
    snapshot = {"cpu_rss": cpu_rss_bytes()}
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        snapshot.update(
            gpu_allocated=torch.cuda.memory_allocated(index),
            gpu_reserved=torch.cuda.memory_reserved(index),
            gpu_peak=torch.cuda.max_memory_allocated(index),
            gpu_total=torch.cuda.get_device_properties(index).total_memory,
        )
        util = _nvml_utilisation(index)
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


def _nvml_utilisation(index: int) -> float | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return float(nvml.nvmlDeviceGetUtilizationRates(nvml.nvmlDeviceGetHandleByIndex(index)).gpu)
    except Exception:
        return None


def device_facts() -> list[dict]:
    """Devices a job can use, without initialising CUDA: CPU first, then each GPU NVML sees.

    Each entry: ``{"device": "cpu" | "cuda:N", "name", "total" (bytes, GPUs), "free" (bytes, GPUs)}``.
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
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            name = nvml.nvmlDeviceGetName(handle)
            facts.append(
                {
                    "device": f"cuda:{i}",
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "total": int(memory.total),
                    "free": int(memory.free),
                }
            )
    except Exception:
        pass
    return facts
