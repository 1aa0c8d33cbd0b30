"""Tables and plots from stored records; no torch, no GPU."""

from bench.report.build import build_report

__all__ = ["build_report"]
