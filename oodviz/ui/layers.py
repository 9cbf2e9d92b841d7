"""The "Which layer?" tab of a run over several layers (``RunConfig.layers``): per detector, its layers ranked
by mean AUROC over the OOD sets (:func:`oodviz.results.layers.layer_ranking`), as a figure and a table."""

from __future__ import annotations

import streamlit as st

from oodviz.columns import COMBINED, COMBINED_DETECTOR, layer_column
from oodviz.figures.plots import layer_ranking_figure
from oodviz.results.layers import layer_ranking

NOTHING_RANKED = (
    "No detector that reads features has scores at several layers in this run (each failed, or none was chosen)."
)


def layers_tab(page) -> None:
    """The figure and the table of :func:`oodviz.results.layers.layer_ranking` for ``page.results`` (a run over several
    layers: the tab is not offered for one)."""
    by_depth = ((page.results.meta or {}).get("layers") or {}).get("depth_order")  # None: runs before it was kept
    layers = by_depth or list(page.results.config.get("layers") or [])
    ranking = layer_ranking(page.results.metrics, layers or None)
    if ranking.empty:
        st.info(NOTHING_RANKED)
        return
    shown = [*layers, COMBINED] if (ranking.layer == COMBINED).any() else layers
    record = (page.results.detectors or {}).get(layer_column(COMBINED_DETECTOR, COMBINED))
    held_out = isinstance(record, dict) and record.get("standardised_on") == "id_val"
    st.caption(
        "Each detector that reads features was fitted and scored at every layer; rank 1 = the highest AUROC "
        "(mean over the OOD sets). Detectors that read only the logits, or run the model, are the same at every "
        f"layer and not listed. **{COMBINED}** ({COMBINED_DETECTOR} only): the sum of the per-layer scores, each "
        "standardised on "
        + ("the held-out ID validation images" if held_out else "the ID fit split (in-sample)")
        + " (Lee et al. 2018)."
    )
    st.plotly_chart(layer_ranking_figure(ranking, shown, by_depth is not None), width="stretch", key="layer-ranking")
    table = ranking.rename(columns={"auroc": "mean AUROC", "fpr95": "mean FPR95"})
    st.dataframe(
        table.style.format({"mean AUROC": "{:.4f}", "mean FPR95": "{:.4f}"}),
        hide_index=True,
        width="stretch",
    )
