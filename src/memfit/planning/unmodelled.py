"""What the callbacks say, and do, under a distributed layout memfit cannot predict per rank."""

from __future__ import annotations

__all__ = ["not_modelled"]


def not_modelled(what: str) -> str:
    """One message naming the layout and what memfit does instead (``what``: e.g. "tensor parallelism")."""
    return (
        f"memfit cannot predict one rank's memory under {what}, so it plans nothing for this run: the batch "
        "size, accumulation and checkpointing stay as you set them, and only the measured peaks are logged "
        "(memfit/measured_peak_*), without a prediction to compare them with."
    )
