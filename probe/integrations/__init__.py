"""Adapters that run :func:`probe.watch` inside the trainers people use.

- :mod:`probe.integrations.huggingface`: ``ProbeCallback`` for ``transformers.Trainer``
  (``pip install attention-probe[hf]``)
- :mod:`probe.integrations.lightning`: ``ProbeCallback`` for a Lightning ``Trainer``
  (``pip install attention-probe[lightning]``; ``lightning`` or ``pytorch_lightning``)

Nothing here is imported by ``import probe``: each submodule imports its framework when it is
imported itself. See ``docs/integrations.md``.
"""
