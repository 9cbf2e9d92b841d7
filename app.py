"""Streamlit entry point: `streamlit run app.py` (or `make app`). The UI lives in oodviz.ui."""

from oodviz.ui.main import main

main()
