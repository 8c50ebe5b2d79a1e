"""Pictures of estimates, plans and drift (needs ``memfit[plot]``); implemented in :mod:`memfit.reporting.plots`."""

from __future__ import annotations

from memfit.reporting.plots import plot_batch_curve, plot_drift, plot_plan, plot_seq_curve, plot_timeline

__all__ = ["plot_batch_curve", "plot_drift", "plot_plan", "plot_seq_curve", "plot_timeline"]
