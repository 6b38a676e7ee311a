"""A watch session: the profiler's lifecycle, the recorder, the schedule and what they consult."""
