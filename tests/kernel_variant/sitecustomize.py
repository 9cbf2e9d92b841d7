"""Loaded by every Python process of a ``make test-kernels`` run, which puts this directory on ``PYTHONPATH`` (the
pytest process and every child it starts: xdist workers, ``oodviz`` commands, torchrun ranks, app servers).

``OODVIZ_TEST_ONEDNN=off`` turns oneDNN (mkldnn) off in that process as soon as it imports torch, so convolutions
run ATen's own kernels (im2col and a BLAS product) instead of oneDNN's: ``torch.backends.mkldnn.flags(enabled=False)``
for the whole process, which no environment variable of PyTorch sets. Torch is not imported here: processes that
must not import it (the result pages, the supervisor; tests/ui/test_page_imports.py) still do not. The other variations
of ``make test-kernels`` (threads, instruction sets) are PyTorch's, oneDNN's and MKL's own environment variables.
"""

import importlib.abc
import importlib.machinery
import os
import sys


class _OneDnnOffOnTorchImport(importlib.abc.MetaPathFinder):
    """Finds ``torch`` as the other finders do and, once its module has run, turns oneDNN off."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_turn_off(module):
            exec_module(module)
            module.backends.mkldnn.enabled = False

        spec.loader.exec_module = exec_then_turn_off
        return spec


if os.environ.get("OODVIZ_TEST_ONEDNN") == "off":
    sys.meta_path.insert(0, _OneDnnOffOnTorchImport())
