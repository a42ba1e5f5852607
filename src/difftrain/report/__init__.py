"""The run report: one self-contained HTML page of a run directory, readable offline."""

from difftrain.report.html import build_report, read_metrics

__all__ = ["build_report", "read_metrics"]
