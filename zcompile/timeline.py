"""``zcompile.timeline.record_step``: the public path of ``zcompile.reports.timeline``."""

from zcompile.reports.timeline import TimelineResult, plot_memory, read_trace, record_step

__all__ = ["record_step", "read_trace", "plot_memory", "TimelineResult"]
