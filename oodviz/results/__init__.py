"""What a run's result files mean, read with pandas and numpy only (no torch): the score and metric tables,
the metrics themselves, the analyses the pages and the report draw (curves, failure cases, risk-coverage, which
layer), chart selections, and the one-line summary of a run.

- :mod:`oodviz.results.tables`: :class:`~oodviz.results.tables.Results`, the run's files as tables.
- :mod:`oodviz.results.metrics`: AUROC, FPR at 95% TPR, AUPR, AURC: float64 formulas.
- :mod:`oodviz.results.leaderboard`: the published OpenOOD v1.5 leaderboard (shipped with oodviz) and a run's
  figures beside it.
- :mod:`oodviz.results.analysis`, :mod:`oodviz.results.layers`, :mod:`oodviz.results.selection`,
  :mod:`oodviz.results.summary`.
"""
