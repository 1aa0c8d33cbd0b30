"""Tables and plots from stored records, without a GPU and without running a step. Plots read the
technique registry (which imports torch) for each technique's colour, so that a colour is the same
in every suite."""

from bench.report.build import build_report

__all__ = ["build_report"]
