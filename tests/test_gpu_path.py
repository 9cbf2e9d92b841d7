"""The CUDA paths that can be checked without a GPU: copies, device choice, NVML mapping, host syncs, precision.

Tensors on the ``meta`` device stand in for a GPU's (no data, any device type but the host's);
``TorchFunctionMode``s record what the code asks torch to do. No test fakes ``torch.cuda`` into a GPU.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from oodviz import Batch
from oodviz.batch import non_blocking_copy

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
