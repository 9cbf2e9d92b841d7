"""oodviz: see which inputs a classifier would wrongly trust, and which OOD detector catches them.

The library never imports streamlit; the app lives in :mod:`oodviz.ui`. ``Batch`` and ``OOD_LABEL``
are imported on first use, so that small processes (a run's supervisor) need not load torch.
"""

__version__ = "0.1.0"
__all__ = ["Batch", "OOD_LABEL", "__version__"]


def __getattr__(name: str):
    if name in ("Batch", "OOD_LABEL"):
        from oodviz import batch

        return getattr(batch, name)
    raise AttributeError(f"module 'oodviz' has no attribute {name!r}")
