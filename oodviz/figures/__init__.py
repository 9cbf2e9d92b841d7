"""Pictures of results: Plotly figures (pure functions of :mod:`oodviz.results`), image thumbnails, the feature
map's projection, the HTML report and figure files. Never imports streamlit.
"""
