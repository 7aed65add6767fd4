"""Evaluation: the paper's six benchmarks, methods and baselines over one engine, metrics and the report.

Nothing on the decoding path imports this package."""
