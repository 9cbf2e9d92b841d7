"""The app page. For now it lists the detector library; the run and analysis pages come next."""

import streamlit as st

from oodviz.detectors import available, detector_class


def main() -> None:
    st.set_page_config(page_title="oodviz", layout="wide")
    st.title("oodviz")
    st.write(
        "Which inputs would your classifier wrongly trust, and which out-of-distribution detector catches them? "
        "The detector library is ready (`from oodviz.detectors import create`); choosing a backbone and datasets, "
        "running jobs and the analysis pages are being built."
    )
    st.caption("Convention everywhere: OOD is the positive class; higher score = more OOD.")
    rows = []
    for name in available():
        cls = detector_class(name)
        rows.append(
            {
                "detector": name,
                "what it scores": cls.summary,
                "reads": ", ".join(cls.inputs) + (" + head" if cls.needs_head else ""),
                "fit": "labels" if cls.needs_labels else ("yes" if cls.needs_fit else "none"),
                "paper": cls.paper,
            }
        )
    st.dataframe(rows, hide_index=True, use_container_width=True, column_config={"paper": st.column_config.LinkColumn()})
