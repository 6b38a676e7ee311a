"""One module per path: each turns the calls the plan gives it into per-row statistics
(:class:`probe.stats.rows.Rows`) and, where it has a backward, per-row ``Σ (∂L/∂Z)²``."""
