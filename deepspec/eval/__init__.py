"""Evaluation: the runner (`deepspec eval`), benchmarks, metrics, bootstrap intervals, the report.

The decoding loops it measures are `deepspec.decoding`; the drafters without trained weights it can run
(prompt lookup alone, the target as its own draft) are `deepspec.drafts.model_free`.  See docs/metrics.md.
"""
