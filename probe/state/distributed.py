"""Cross-rank reduction of probe's statistics under ``torch.distributed``.

Each rank accumulates its own per-site state (:mod:`probe.state.accumulator`). At a flush every
rank of the group calls :meth:`Reducer.reduce`, which returns, on every rank, the state one
process would have accumulated over the union of the ranks' batches:

- counts and sums (``rows``, ``entropy@s``, ``grad_*_sq``, ``nonfinite``, ...) are added,
- maxima (``logit_max@s``) are the maximum over ranks,
- the moments ``logit@s`` = (n, mean, M2) are pooled exactly with the k-way form of Chan's
  formula, ``n = Σ nᵢ``, ``mean = Σ nᵢ·meanᵢ / n``, ``M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ - mean)²``
  (no ``Σx² - n·mean²`` cancellation: every term is a sum of non-negative numbers),
- ``scale`` (last) is taken from the highest rank that has it.

How (the cost of a flush): the ranks agree on one *global layout*, the ordered list of
``(site, field, shape)`` any rank has ever produced. Each rank packs its state into that layout
(identity values where it has nothing: 0 for sums and moments, -inf for maxima), appends one
presence flag per entry, its cumulative call count per site, its step and the number of entries it
holds that the layout lacks. One ``all_gather`` of that float64 tensor follows, then one
device→host copy and the combine above on the host. In the steady state that is **one
collective per flush**. When some rank reports unknown entries (the first flush, a new site, a
branch taken on one rank only) every rank sees it in the gathered tensor, so all take the same
path: one ``all_gather_object`` of the missing layout entries and a second ``all_gather``. Ranks
that sample different numbers of calls, see different sequence lengths or different sites
therefore never hang: the shapes of every collective are identical on every rank.

Pitfall: collectives pair up by order, so **every rank must flush at the same steps**. They do
when each rank runs the watched model's root forward the same number of times per step (or calls
``p.step(n)`` with the same ``n``); a rank-0-only evaluation forward through the watched model
would shift its steps. The step number travels with the data and a mismatch produces a warning.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Hashable, List, Mapping, Optional, Set, Tuple

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.state.accumulator import Entries
from probe.state.combine import Entry, Layout, State

__all__ = ["Reducer", "combine_ranks", "resolve_group"]




def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def resolve_group(group: Any) -> Optional["Reducer"]:
    """The reducer for the ``group=`` option of :class:`probe.Probe`, or ``None`` for local statistics.

    Args:
        group: ``None`` (default): the default process group when ``torch.distributed`` is
            initialized with more than one rank, else local statistics; a ``ProcessGroup``: that
            group; ``False``: local statistics on every rank even under ``torch.distributed`` (each
            rank is then a separate probe and writes its own ``logdir``).

    Raises:
        ProbeError: for a group that is not a ProcessGroup, or one given while
            ``torch.distributed`` is not initialized.
    """
    if group is False:
        return None
    if group is None:
        if not _initialized():
            return None
        group = torch.distributed.group.WORLD
        if torch.distributed.get_world_size(group) == 1:
            return None
        return Reducer(group)
    if isinstance(group, bool) or not isinstance(group, torch.distributed.ProcessGroup):
        raise ProbeError(
            f"expected `group` to be None, False or a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    if not _initialized():
        raise ProbeError("`group` was given but torch.distributed is not initialized; call init_process_group first")
    return Reducer(group)


def _numel(shape: Tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


class Reducer:
    """Agrees on a global layout and reduces packed per-rank state across a process group.

    Every public method that communicates is a collective: call it on every rank of the group,
    the same number of times, in the same order.

    Args:
        group: the process group (rank 0 of this group is the one that writes).
    """

    def __init__(self, group: Any) -> None:
        dist = torch.distributed
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world: int = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        # NCCL only moves CUDA tensors; gloo and others gather on the host.
        if "nccl" in backend and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.entries: List[Entry] = []
        self._index: Dict[Tuple[Hashable, str], int] = {}
        self.keys: List[Hashable] = []
        self._key_index: Dict[Hashable, int] = {}
        self.infos: Dict[Hashable, Dict[str, Any]] = {}
        self._layout: Optional[Layout] = None
        self._identity: Dict[torch.device, Tensor] = {}
        self.collectives = 0  # collectives issued so far (for tests and the cost table in the docs)
        self._warned_steps = False

    def usable(self) -> bool:
        """Whether the process group can still communicate (not after destroy_process_group)."""
        return _initialized()

    # -- layout ----------------------------------------------------------------------------------
    def _unknown(self, states: Mapping[Any, State]) -> List[Entry]:
        """This rank's (site, field, shape) entries that the global layout lacks."""
        return [
            (key, field, tuple(value.shape))
            for key, state in states.items()
            for field, value in state.items()
            if (key, field) not in self._index
        ]

    def _agree(self, states: Mapping[Any, State], infos: Mapping[Any, Dict[str, Any]]) -> None:
        """Exchange the entries some rank lacks (one ``all_gather_object``) and extend the layout
        in rank order, so that every rank builds the same layout."""
        entries = self._unknown(states)
        # Info travels with the layout, once per site (it is static); "calls" is summed every flush.
        site_infos = {key: {k: v for k, v in infos.get(key, {}).items() if k != "calls"} for key, _, _ in entries}
        gathered: List[Any] = [None] * self.world
        torch.distributed.all_gather_object(gathered, (entries, site_infos), group=self.group)
        self.collectives += 1
        for rank_entries, rank_infos in gathered:
            for key, info in rank_infos.items():
                self.infos.setdefault(key, {}).update(info)
            for key, field, shape in rank_entries:
                if key not in self._key_index:
                    self._key_index[key] = len(self.keys)
                    self.keys.append(key)
                if (key, field) in self._index:
                    if self.entries[self._index[key, field]][2] != shape:
                        raise ProbeError(
                            f"site {key!r} field {field!r} has shape {shape} on one rank and "
                            f"{self.entries[self._index[key, field]][2]} on another: the ranks run different models"
                        )
                    continue
                self._index[key, field] = len(self.entries)
                self.entries.append((key, field, shape))

    def multi_names(self) -> Set[str]:
        """Module names that issued several calls per invocation on some rank (``#n`` suffixes)."""
        return {key[0] for key in self.keys if isinstance(key, tuple) and len(key) == 2 and key[1] > 0}

    # -- pack / gather ---------------------------------------------------------------------------
    def _pack(self, states: Mapping[Any, State], infos: Mapping[Any, Dict[str, Any]], step: int) -> Tensor:
        """values (global layout, identity-filled) | presence per entry | calls per site | step, unknown."""
        # Pack where the state lives (the model's device) and move once: one transfer, not one per
        # field. Entries this rank lacks are slices of a cached identity tensor: no allocation.
        device = next((v.device for state in states.values() for v in state.values()), self.device)
        identity = self._identity_on(device)
        parts: List[Tensor] = []
        present = [0.0] * len(self.entries)
        offset = 0
        for i, (key, field, shape) in enumerate(self.entries):
            size = _numel(shape)
            value = states.get(key, {}).get(field)
            if value is None:
                parts.append(identity[offset : offset + size])
            else:
                parts.append(value.detach().reshape(-1).to(torch.float64))
                present[i] = 1.0
            offset += size
        calls = [float(infos.get(key, {}).get("calls", 0)) for key in self.keys]
        tail = present + calls + [float(step), float(len(self._unknown(states)))]
        parts.append(torch.tensor(tail, dtype=torch.float64).to(device))
        return torch.cat(parts).to(self.device)

    def _all_gather(self, flat: Tensor) -> Tensor:
        out = torch.empty(self.world * flat.numel(), dtype=flat.dtype, device=flat.device)
        # all_gather_single (torch >= 2.13) is what all_gather_into_tensor became; both write one
        # contiguous output, which NCCL and gloo fill without a list of per-rank buffers.
        gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
        gather(out, flat, group=self.group)
        self.collectives += 1
        return out.view(self.world, flat.numel())

    def reduce(
        self, states: Mapping[Any, State], infos: Mapping[Any, Dict[str, Any]], step: int
    ) -> Tuple[Tensor, Entries, Dict[Any, Dict[str, Any]]]:
        """Reduce this rank's state with every other rank's (a collective; see the module doc).

        Args:
            states: this rank's accumulator states (site key → field → per-head tensor); may be empty.
            infos: this rank's site infos; ``calls`` is the cumulative number of calls.
            step: the step this flush closes (all ranks should pass the same).

        Returns:
            ``(flat, layout, infos)``: the global state of the sites present on some rank, packed
            on the host in float64 as :func:`probe.state.accumulator.unpack` reads it, and the
            global infos (``calls`` summed over ranks) of those sites.
        """
        while True:
            host = self._all_gather(self._pack(states, infos, step)).to("cpu", torch.float64)
            if not bool((host[:, -1] > 0).any()):
                break
            self._agree(states, infos)  # every rank saw the same flags: all take this branch
        steps = host[:, -2]
        if not self._warned_steps and bool((steps != steps[0]).any()):
            self._warned_steps = True
            warnings.warn(
                f"probe: ranks flushed at different steps ({[int(s) for s in steps.tolist()]}); statistics of "
                "different steps were combined. Run the watched model's root forward the same number of times "
                "on every rank, or call p.step(n) with the same n on every rank.",
                RuntimeWarning,
                stacklevel=3,
            )
        return self._combine(host)

    # -- combine (host, float64) -------------------------------------------------------------
    def _plan(self) -> Layout:
        """The global layout's :class:`~probe.state.combine.Layout` (cross-rank kinds), cached."""
        if self._layout is None or len(self._layout.entries) != len(self.entries):
            self._layout = Layout(self.entries, across="ranks")
            self._identity = {}
        return self._layout

    def _identity_on(self, device: torch.device) -> Tensor:
        """The packed identity (0 for sums and moments, -inf for maxima) on ``device``, cached."""
        layout = self._plan()
        if device not in self._identity:
            self._identity[device] = torch.from_numpy(layout.identity()).to(device)
        return self._identity[device]

    def _combine(self, host: Tensor) -> Tuple[Tensor, Entries, Dict[Any, Dict[str, Any]]]:
        """Vectorized over the layout (:meth:`probe.state.combine.Layout.reduce`): one reduction
        per kind, not one per field (a model has hundreds of fields)."""
        layout = self._plan()
        total, entries = layout.size, len(self.entries)
        presence = host[:, total : total + entries] > 0
        calls = host[:, total + entries : total + entries + len(self.keys)].sum(0)
        out = layout.reduce(host[:, :total], presence)
        kept = presence.any(0)
        flat = out[kept[torch.from_numpy(layout.owner)]]
        packed: Entries = [entry for entry, keep in zip(self.entries, kept.tolist()) if keep]
        keys = {key for key, _, _ in packed}
        infos = {
            key: dict(self.infos.get(key, {}), calls=int(calls[self._key_index[key]]))
            for key in self.keys
            if key in keys
        }
        return flat, packed, infos


def combine_ranks(field: str, values: Tensor, present: Tensor) -> Tensor:
    """Reduce one field's per-rank values ``(world, *shape)`` over the ranks where ``present``
    (:meth:`probe.state.combine.Layout.reduce` on a layout of that one field)."""
    layout = Layout([(None, field, tuple(values.shape[1:]))], across="ranks")
    parts = values.reshape(values.shape[0], -1).clone()
    absent = ~present.reshape(-1)
    parts[absent] = torch.from_numpy(layout.identity()).to(parts)
    return layout.reduce(parts, present.reshape(-1, 1)).reshape(values.shape[1:])
