"""Where a model runs: device names parsed in one place, and a model held on a device for a block.

- :func:`parse_device`: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` ->
  the ``torch.device`` to run on, checked against the hardware here (``"auto"`` = the current GPU
  when there is one, else the CPU; ``"cuda"`` gets the current GPU's index, so two spellings of
  one GPU compare equal).
- :func:`device_problem`: the spelling check alone, without looking at the hardware (what a run
  config validates, before the run reaches the machine that will do the work).
- :func:`model_on_device`: a block with the model on the job's device in eval mode, after which
  the model is exactly as it was (device of every tensor, train/eval flags, memory format).
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

#: The device names a run accepts (``N`` = a GPU number, from 0).
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
_DEVICE_TEXT = re.compile(r"auto|cpu|cuda|cuda:(0|[1-9][0-9]*)", re.ASCII)


def device_problem(device) -> str | None:
    """What is wrong with how ``device`` is written, or ``None`` when it is one of :data:`DEVICE_CHOICES`
    (a ``torch.device`` of type cpu or cuda is fine too). The hardware is not looked at."""
    if isinstance(device, torch.device):
        if device.type in ("cpu", "cuda"):
            return None
        return f"device {str(device)!r} is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
    if isinstance(device, str) and _DEVICE_TEXT.fullmatch(device):
        return None
    return (
        f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N = the GPU number, from 0), got {device!r}; "
        "'auto' takes the GPU when there is one"
    )


def parse_device(device="auto") -> torch.device:
    """The ``torch.device`` that ``device`` names on this machine.

    ``"auto"`` -> ``cuda:<current>`` when CUDA is available, else ``cpu``; ``"cuda"`` ->
    ``cuda:<current>``; ``"cuda:N"`` -> ``cuda:N``; ``"cpu"`` -> ``cpu``. A ``torch.device`` of type
    cpu or cuda is checked the same way.

    :raises ValueError: for any other spelling (see :func:`device_problem`), for a CUDA device when
        CUDA is not available here, and for a GPU number beyond the visible GPUs; the message says
        which devices to use instead
    """
    problem = device_problem(device)
    if problem is not None:
        raise ValueError(problem)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r} but CUDA is not available here (no GPU is visible to PyTorch); "
            "use device='cpu' or 'auto'"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"device={str(device)!r} but only {count} GPU{'s are' if count > 1 else ' is'} visible here "
            f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); choose one of them, or 'auto'"
        )
    return torch.device("cuda", index)


class _ModelState:
    """Where every parameter and buffer of a module lives and which submodules are training."""

    def __init__(self, model: nn.Module, track_format: bool):
        self.model = model
        self.training = [(m, m.training) for m in model.modules()]
        self.tensors = []  # (module, kind, name, device, memory_format)
        for module in model.modules():
            for kind, items in (
                ("param", module.named_parameters(recurse=False)),
                ("buffer", module.named_buffers(recurse=False)),
            ):
                for name, tensor in items:
                    fmt = torch.preserve_format
                    if track_format and tensor.dim() == 4:
                        is_cl = tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()
                        fmt = torch.channels_last if is_cl else torch.contiguous_format
                    self.tensors.append((module, kind, name, tensor.device, fmt))

    def restore(self) -> None:
        with torch.no_grad():
            for module, kind, name, device, fmt in self.tensors:
                current = dict(
                    module.named_parameters(recurse=False) if kind == "param" else module.named_buffers(recurse=False)
                )
                tensor = current.get(name)
                if tensor is None:
                    continue
                if tensor.device != device or fmt is not torch.preserve_format:
                    tensor.data = tensor.data.to(device=device, memory_format=fmt)
                if kind == "param" and tensor.grad is not None and tensor.grad.device != device:
                    tensor.grad = tensor.grad.to(device)
        for module, flag in self.training:
            module.training = flag


@contextlib.contextmanager
def model_on_device(model, device, channels_last: bool = False):
    """Run a block with ``model`` on ``device`` in eval mode, then put it back exactly as it was.

    A model that is not an ``nn.Module`` (a function, any callable) is left alone.
    ``channels_last=True`` also converts 4-D weights to channels-last for the block.
    """
    if not isinstance(model, nn.Module):
        yield model
        return
    state = _ModelState(model, track_format=channels_last)
    try:
        model.to(device)
        if channels_last:
            model.to(memory_format=torch.channels_last)
        model.eval()
        yield model
    except BaseException as err:
        # After a sticky CUDA error the restore's own copies fail too: the block's error is the one to raise.
        try:
            state.restore()
        except Exception as restore_err:
            err.add_note(
                f"oodviz could not put the model back where it was afterwards ({type(restore_err).__name__}: "
                f"{restore_err}); the model may be left on {device}"
            )
        raise
    state.restore()
