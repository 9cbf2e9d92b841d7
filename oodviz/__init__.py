"""oodviz: see which inputs a classifier would wrongly trust, and which OOD detector catches them.

The library never imports streamlit; the app lives in :mod:`oodviz.ui`.
"""

from oodviz.batch import OOD_LABEL, Batch

__version__ = "0.1.0"
__all__ = ["Batch", "OOD_LABEL", "__version__"]
