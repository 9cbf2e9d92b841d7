"""How a run runs, in the worker: the job and its stages (extract, fit, tune, score, combine layers, save),
the pre-flight check and batch probe before it, model passes, sharded runs over torch.distributed, rescoring new
images with a finished run's saved detectors.

- :mod:`oodviz.pipeline.job`: :class:`~oodviz.pipeline.job.Job`, what every stage reads and writes.
- :mod:`oodviz.pipeline.stages`: :func:`~oodviz.pipeline.stages.run_pipeline`, the stages in order.
- :mod:`oodviz.pipeline.preflight`, :mod:`oodviz.pipeline.batchprobe`, :mod:`oodviz.pipeline.probe`: what a
  run will need, measured before it starts.
- :mod:`oodviz.pipeline.worker`, :mod:`oodviz.pipeline.reporter`: the process that runs a job, its progress.
- :mod:`oodviz.pipeline.sharded`, :mod:`oodviz.pipeline.distributed`: one run over several processes.
- :mod:`oodviz.pipeline.scoring`: a finished run's detectors on new images.
"""
