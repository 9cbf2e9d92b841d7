"""The app's entry script: ``streamlit run`` executes it on every rerun (``oodviz app`` finds it in the package)."""

from oodviz.ui.main import main

main()
