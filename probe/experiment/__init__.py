"""Experiments on the scale: overrides (``probe.scaling``), learnable variants, comparisons."""
