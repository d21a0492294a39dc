"""The benchmark: the pack's checkpointing plans side by side, and against the host's built-in trainer.

``python bench/run.py`` is the command (see bench/README.md). The modules here that import no
host code (:mod:`.steps`, :mod:`.table`, :mod:`.plot`, :mod:`.configs`) are shared with the
Benchmark Checkpointing node (``nodes/benchmark.py``), so that the node and the benchmark
measure, compare and draw in one way.
"""
