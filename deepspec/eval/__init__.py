"""Evaluation: the runner (`deepspec eval`), benchmarks, metrics, bootstrap intervals, the report.

The decoding loops it measures are `deepspec.decoding`; the reference drafters (`reference_drafters`) are
eval-only drafters with known acceptance.  See docs/metrics.md.
"""
