"""Cache-hit threshold: admission control for P/D-disaggregated serving."""
