"""The bench stage (``stage.py``: ``BenchStage``, ``run_bench``), its light ``config.py``, the
engines it compares (``engine_*.py``), its measurements (``latency.py``, ``accuracy.py``,
``flops.py``), its tables and summary (``summary.py``, ``accuracy_rows.py``, ``report.py``) and its
gates (``gates.py``). Importing the package loads nothing."""
