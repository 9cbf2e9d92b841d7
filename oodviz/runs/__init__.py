"""Runs as files and processes: a run directory (:mod:`oodviz.runs.rundir`: config, status, events, results), the
queue of runs and their worker processes (:mod:`oodviz.runs.jobs`, :mod:`oodviz.runs.supervise`,
:mod:`oodviz.runs.launch`), and the machine's memory as the live panel shows it (:mod:`oodviz.runs.telemetry`).
Nothing here imports torch or knows what a run computes: that is :mod:`oodviz.pipeline`.
"""
