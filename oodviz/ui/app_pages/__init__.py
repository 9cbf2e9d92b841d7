"""The app's page scripts, one per page of :data:`oodviz.ui.navigation.PAGES`: Streamlit executes the page shown on
each rerun (``st.navigation``). Each only calls its page's function; the page itself lives beside the others in
``oodviz.ui``."""
