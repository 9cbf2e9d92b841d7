"""`streamlit run app.py` from a checkout: runs the entry script inside the package, oodviz/ui/app.py,
the one `oodviz app` and `make app` start."""

import runpy

from oodviz.ui import APP_SCRIPT

runpy.run_path(str(APP_SCRIPT), run_name="__main__")
