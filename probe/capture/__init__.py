"""Capture front ends: turn intercepted attention computations into AttentionCall records."""
