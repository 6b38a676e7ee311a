"""CI: threshold expressions and checks, run and event-file readers, ``probe check``, the pytest plugin."""
