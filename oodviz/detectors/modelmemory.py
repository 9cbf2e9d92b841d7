"""The batch size of a model-based detector from memory (``odin``, ``mcd``: they run the model again).

A model-based detector's memory grows with its batch: ODIN keeps every activation of the forward pass for
its backward pass, and their gradients (~99 MiB per 224-pixel image for resnet50), far more than
extraction under ``inference_mode`` needs. The batch it is given (the run's extraction batch size) is
therefore scored in chunks of

    rows = max(1, floor(MEMORY_FRACTION x available / (copies x a)))

inputs, where ``a`` is the bytes of the outputs of every leaf module for one input, measured by one forward
pass with hooks (:func:`activation_bytes`; no graph, the random state restored, so dropout draws nothing),
``copies`` the detector's ``activation_copies`` (ODIN 2: the activations and their gradients) and
``available`` the device's free memory (CUDA) or the host's available RAM. The out-of-memory back-off of
:mod:`oodviz.engine.batched` stays as the safety net.

This estimate serves a detector scored on its own (``create("odin", model=m).score(batches)``). A run measures
instead: its batch probe (:mod:`oodviz.pipeline.batchprobe`) gives a model-based detector's peak per row and its
fixed part, and the run passes ``rows_within(fixed, per_row, MEMORY_FRACTION x available)`` rows at once
(:func:`oodviz.pipeline.batchprobe.rows_from_memory`).
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch
from torch import Tensor, nn

#: the share of the available memory a model-based detector's activations may take
MEMORY_FRACTION = 0.5
#: rows "without a limit": a batch whose bytes do not grow with its rows
NO_LIMIT = 10**9


def activation_bytes(module: nn.Module, forward: Callable[[Tensor], object], x: Tensor) -> int:
    """Bytes of the tensors every leaf module of ``module`` outputs while ``forward(x)`` runs (without a graph;
    the CPU's and ``x``'s device's random state restored afterwards)."""
    total = 0

    def count(_module, _inputs, output) -> None:
        nonlocal total
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, Tensor):
                total += t.numel() * t.element_size()

    leaves = [m for m in module.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(count) for m in leaves]
    cuda = [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            forward(x)
    finally:
        for handle in handles:
            handle.remove()
    return total


def available_bytes(device: torch.device) -> int:
    """Free memory of a CUDA ``device``, else the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def rows_within(fixed_bytes: int, per_row_bytes: int, available: float) -> int:
    """The most rows with ``fixed_bytes + rows x per_row_bytes <= available`` (0 when not even one;
    :data:`NO_LIMIT` when the rows cost nothing and the fixed part fits)."""
    if per_row_bytes <= 0:
        return NO_LIMIT if fixed_bytes <= available else 0
    return max(0, int((available - fixed_bytes) // per_row_bytes))


def rows_that_fit(per_input_bytes: int, copies: int, device: torch.device) -> int:
    """How many inputs of ``per_input_bytes`` activations (``copies`` of them alive) fit in the memory share."""
    return max(1, rows_within(0, copies * per_input_bytes, MEMORY_FRACTION * available_bytes(device)))
