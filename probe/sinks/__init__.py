"""Sinks: where flushed metrics go (TensorBoard, JSON summary, user sinks)."""
