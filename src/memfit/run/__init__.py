"""During training: measured peaks, drift against the prediction, alarms, out-of-memory recovery."""
