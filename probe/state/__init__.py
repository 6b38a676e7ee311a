"""Measured state: the accumulator, how fields combine over calls, steps and ranks, the run totals."""
