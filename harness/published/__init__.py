"""Published GPU memory measurements, predicted by memfit from their configurations alone."""
