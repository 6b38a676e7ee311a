"""The ``probe`` command line (:func:`probe.cli.main.main`); importing this package imports nothing."""
