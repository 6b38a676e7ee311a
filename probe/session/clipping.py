"""``probe.watch(model, qk_clip=τ)``: QK-Clip driven by the measured max logits, every optimizer step.

What :class:`Clipping` does for a :class:`~probe.session.profiler.Probe`:

* **Measures every training forward.** Each root forward run with autograd enabled (a training
  step; evaluation under ``torch.no_grad`` is not counted) is captured, sampled or not: on steps
  that are not sampled the recorder computes the max logits only (:mod:`probe.stats.max_logit`:
  one ``q·kᵀ`` per call, no exponential); on sampled steps it takes ``logit_max@actual`` from the
  full statistics. Per site, the max over the forwards since the last clip (micro-batches of
  gradient accumulation) is kept on the device.
* **Knows what to scale.** The first measured forward (and any forward after the model's
  parameters or sites changed) is followed by :class:`probe.capture.provenance.Trace`; each site
  is resolved into the entries its q and k heads scale with, or refused with its reason (warned
  once, and in ``summary.info(site)["qk_clip"]``).
* **Clips after each optimizer step.** A global optimizer step post-hook runs after the step of
  any optimizer holding a clipped weight (or, when no site can be clipped, any of the model's
  parameters): the per-head maxima are reduced over the ranks (``MAX``, so that every replica
  applies the same factors), and the sites whose weights that optimizer holds (:meth:`Clipping._due`:
  a site another optimizer updates waits for its step) are turned into factors
  (:mod:`probe.experiment.clip_rule`), applied in place, and recorded as ``qk_clip_logit`` (S),
  ``qk_clip_factor`` (γ, 1 when not clipped) and ``qk_clip_steps`` (steps clipped) for the sinks
  and the summary. A step inside a trainer's recording window starts a fresh trace for what runs
  after it (:meth:`Clipping._follow_on`).

Pitfall: the rule uses the max logit of the forward *before* the update, as published; the next
forward's max logit may exceed τ by what one optimizer step adds (docs/qk_clip.md).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from probe.call import AttentionCall
from probe.capture.provenance import Refusal, SiteProvenance, Trace
from probe.capture.sites import site_names
from probe.experiment.clip_rule import factors, scale_site
from probe.once import WarnOnce
from probe.errors import ProbeError
from probe.session.compiled import is_compiled
from probe.session.options import check_tau
from probe.session.recorder import Recorder, SiteInfo, SiteKey

__all__ = ["Clipping", "Riders", "clipping"]


def _world() -> Optional[Any]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def clipping(model: nn.Module, tau: Any, recorder: Recorder, warn: Callable[[str], None], records: bool,
             every: Optional[int]) -> Optional["Clipping"]:
    """The :class:`Clipping` of ``Probe(model, qk_clip=tau)``, its argument checked (``None``: no clip)."""
    if tau is None:
        return None
    tau = check_tau("qk_clip", tau)
    if is_compiled(model):
        raise ProbeError("qk_clip measures every training forward in eager mode; a compiled model would run "
                         "eagerly at every step: watch the model before torch.compile, and compile its blocks")
    return Clipping(model, tau, recorder, warn, records, opens_steps=every is None)


class Clipping:
    """QK-Clip for one probe (see the module docstring).

    Args:
        model: the watched root module.
        tau: the threshold τ on each head's max logit.
        recorder: the probe's recorder (it reports each call's max logits to :meth:`on_call`).
        warn: the probe's warning channel.
        records: whether this process adds the clip's records to the accumulator (under a
            cross-rank reducer, rank 0 only: the clip's values are global already).
    """

    def __init__(self, model: nn.Module, tau: float, recorder: Recorder, warn: Callable[[str], None],
                 records: bool = True, opens_steps: bool = True) -> None:
        self._model = weakref.ref(model)  # a forgotten probe keeps no model alive (as the recorder)
        self.tau = float(tau)
        self.rec = recorder
        self._warn = warn
        self._warn_once = WarnOnce()
        self.records = records
        self.opens_steps = opens_steps
        self.sites: Dict[SiteKey, Any] = {}  # SiteProvenance or Refusal
        self._heads: Dict[SiteKey, Tuple[int, int]] = {}  # (heads, kv heads)
        self._top: Dict[SiteKey, Tensor] = {}  # max logit per head since the last clip
        self._trace: Optional[Trace] = None
        self._unverified: Set[SiteKey] = set()
        self._modules: Dict[str, nn.Module] = {}
        self._pending: Dict[SiteKey, Any] = {}
        self._signature: Optional[Tuple[int, ...]] = None
        self._retrace = True
        self._layout: Optional[List[Tuple[SiteKey, int]]] = None  # the cross-rank packing order
        self._clipped: Set[SiteKey] = set()  # sites an optimizer step has handled at least once
        self._stepped = False  # an optimizer step holding the model's weights came
        # the global hook holds the clip weakly: an unclosed probe is still collected (and closed)
        ref = weakref.ref(self)
        self._handle = register_optimizer_step_post_hook(
            lambda opt, args, kwargs: (lambda c: c is not None and c._on_optimizer_step(opt, args, kwargs))(ref()))
        weakref.finalize(self, self._handle.remove)
        recorder.on_logit_max = self.on_call

    # -- forwards --------------------------------------------------------------------------------
    @staticmethod
    def measures() -> bool:
        """Whether the forward starting now counts for the clip (autograd on: a training forward)."""
        return torch.is_grad_enabled()

    def start(self) -> None:
        """A measured forward begins (the capture mode is entered): follow it if provenance is due."""
        model = self._model()
        if model is None:
            return
        signature = tuple(id(p) for p in model.parameters())
        if signature != self._signature:  # new parameters: what was traced may no longer hold
            self._signature, self._retrace, self.sites = signature, True, {}
        if self._retrace and self._trace is None:
            self._retrace = False
            self._pending = {}
            names = site_names(model)
            self._modules = {names[id(m)]: m for m in model.modules() if id(m) in names}  # by site name
            self._trace = Trace(model, names)
            self._trace.__enter__()

    def stop_mode(self) -> None:
        """Leave the trace's mode (above the capture mode: popped first)."""
        if self._trace is not None and self._trace in torch.overrides._get_current_function_mode_stack():
            self._trace.__exit__(None, None, None)

    def end(self) -> None:
        """The capture ended (its mode emitted everything): settle provenance, forget the trace."""
        self.settle()
        self._trace, self._modules = None, {}

    def settle(self) -> None:
        """Resolve the traced sites (the forward is over: an optimizer step, or the capture's end);
        the trace then passes every op through (a trainer's recording window may go on through the
        backward and the optimizer step)."""
        trace = self._trace
        if trace is None or trace.passive:
            return
        trace.passive = True
        settled = {key: trace.finish(found) for key, found in self._pending.items()}
        # a window traced in parts (_follow_on) adds to the sites; a refusal stays, until new parameters
        settled = {key: found for key, found in settled.items() if not isinstance(self.sites.get(key), Refusal)}
        self.sites.update(settled)
        self._pending = {}
        self._layout = None
        for key, found in settled.items():
            if key in self._unverified:
                continue
            with self.rec.lock:
                info = self.rec.infos.get(key)
                if info is not None:
                    info.qk_clip = found.describe()
            if isinstance(found, Refusal):
                self._warn_refused(key, found.reason)

    def _follow_on(self) -> None:
        """An optimizer step came while the trace was following the forwards (a trainer's window:
        under Lightning's manual optimization a GAN's critic may run after the generator's step):
        follow what runs next with a fresh trace, so a site first called after the step is traced
        too, and the calls of each part (between two optimizer steps) are counted alone."""
        model, stack = self._model(), torch.overrides._get_current_function_mode_stack()
        if model is None or not stack or stack[-1] is not self._trace:
            return  # not on top: left passive; a site it misses is warned at its step (step())
        self._trace.__exit__(None, None, None)
        self._trace = Trace(model, site_names(model))
        self._trace.__enter__()

    def _warn_refused(self, key: SiteKey, reason: str) -> None:
        site = self.rec.site_name(key)
        self._warn_once(site, f"probe: qk_clip does not clip site {site!r}: {reason}")

    def _refuse(self, key: SiteKey, reason: str) -> None:
        """Never clip ``key`` again (its record was found not to reproduce the model)."""
        self._unverified.add(key)
        with self.rec.lock:
            info = self.rec.infos.get(key)
            if info is not None:
                info.qk_clip = Refusal(reason).describe()
        self._warn_refused(key, reason)

    def on_call(self, key: SiteKey, call: AttentionCall, top: Optional[Tensor]) -> None:
        """One recorded call of a measured forward (from the recorder)."""
        if self._trace is not None and not self._trace.passive:
            self._pending[key] = self._trace.resolve(call, self._modules.get(key[0]))
        elif key not in self.sites:
            self._retrace = True  # a site not seen when the model was traced: trace the next forward
        self._heads[key] = (call.heads, call.kv_heads)
        with self.rec.lock:
            if key not in self.rec.infos:  # a site seen on steps measured for the clip only
                self.rec.infos[key] = SiteInfo(call.kind, call.heads, call.kv_heads, call.d_k, softcap=call.softcap,
                                               scale_from=call.scale_from)
        if top is None:  # not measured (scale unknown, unverified): recorded as no data, never clipped
            if self.rec.verifier.unverified(key) and key not in self._unverified:
                self._refuse(key, "probe's record of its attention does not reproduce the model's own result "
                             "(the site is unverified): its max logits are not trusted")
            top = torch.full((call.heads,), float("-inf"), device=call.q.device)
        top = top.detach().float()
        prev = self._top.get(key)
        self._top[key] = top if prev is None or prev.shape != top.shape else torch.maximum(prev, top)

    # -- optimizer steps ---------------------------------------------------------------------------
    def _targets(self) -> Set[int]:
        out = set()
        for found in self.sites.values():
            if isinstance(found, SiteProvenance):
                for rows in (found.q, found.k):
                    module = rows.module()
                    if module is not None:
                        out.add(id(module._parameters[rows.weight]))
        model = self._model()
        return out or (set() if model is None else {id(p) for p in model.parameters()})

    def _scaled(self, found: SiteProvenance) -> List[Tensor]:
        """The parameters a site's q and k heads are scaled through (``_targets``'s, for one site)."""
        modules = ((rows.module(), rows.weight) for rows in (found.q, found.k))
        return [module._parameters[weight] for module, weight in modules if module is not None]

    def _due(self, key: SiteKey, held: Optional[Set[int]]) -> bool:
        """Whether the step of the optimizer holding ``held`` (parameter ids) clips ``key``: a site
        whose scaled weights it holds, or that no optimizer updates (frozen weights: any step, as a
        site refused or not traced is recorded at any step). A site whose weights another optimizer
        updates waits for that one's step: a GAN's critic is clipped after the critic's step, from
        the critic's forwards since its last clip, not after the generator's."""
        found = None if key in self._unverified else self.sites.get(key)
        if held is None or not isinstance(found, SiteProvenance):
            return True
        params = self._scaled(found)
        return any(id(p) in held for p in params) or not any(p.requires_grad for p in params)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            tracing = self._trace is not None and not self._trace.passive
            self.settle()
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if held & self._targets():
                self.step(held)
            if tracing:  # after the clip: its own in-place scaling is not followed
                self._follow_on()
        except Exception as err:  # noqa: BLE001 - a training loop never dies because of probe
            self._warn(f"probe: qk_clip failed after an optimizer step ({type(err).__name__}: {err}); "
                       "the weights of that step were not clipped")

    def _reduced(self) -> Dict[SiteKey, Tensor]:
        """The max logits since the last clip, reduced over the ranks (every rank the same): one
        ``MAX`` all-reduce of every site's heads, packed in an order all ranks share (the union of
        their sites, gathered again whenever a rank traced again)."""
        dist = _world()
        if dist is None:
            return dict(self._top)
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        stale = torch.tensor([float(self._layout is None)], device=device)
        dist.all_reduce(stale, op=dist.ReduceOp.MAX)
        if bool(stale.item()):
            mine = sorted((key, self._heads[key][0]) for key in self._heads)
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            union = {(tuple(key), heads) for rank in gathered for key, heads in rank}
            self._layout = sorted(union)  # type: ignore[arg-type]
        parts = [torch.nan_to_num(self._top[key].to(device), nan=float("inf")) if key in self._top  # NaN: never clipped
                 else torch.full((heads,), float("-inf"), device=device) for key, heads in self._layout]
        flat = torch.cat(parts) if parts else torch.zeros(0, device=device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        return dict(zip((key for key, _ in self._layout), flat.split([heads for _, heads in self._layout])))

    def step(self, held: Optional[Set[int]] = None) -> None:
        """Clip the sites due at the step of the optimizer holding ``held`` (parameter ids;
        ``None``: every site, see :meth:`_due`) from their max logits measured since their last
        clip; record what was done."""
        if self.sites and not any(self._due(key, held) for key in self._top):
            self._warn_once("unmeasured", "probe: qk_clip: an optimizer step came with no training forward measured "
                            "since the last clip (paused, no_grad, or a compiled graph): nothing was clipped")
        self._stepped = True
        tops = self._reduced()
        step = self.rec.step
        bad = []
        done = [key for key in tops if key in self._heads and self._due(key, held)]  # others: another rank's
        for key in done:
            top = tops[key]
            self._top.pop(key, None)
            self._clipped.add(key)
            found = None if key in self._unverified else self.sites.get(key)
            if isinstance(found, SiteProvenance) and found.kv_of.numel() == top.shape[0]:
                g, a, b = factors(top, self.tau, found.kv_of)
                scale_site(found, a, b)
            else:
                g = torch.ones_like(top)  # refused (or not traced yet): nothing scaled
                if found is None and key not in self._unverified:
                    site = self.rec.site_name(key)
                    self._warn_once(f"untraced:{site}", f"probe: qk_clip did not clip site {site!r} at step {step}: "
                                    "it first ran in a forward probe did not trace; it is traced on its next one")
            bad.append((key, (torch.isnan(top) | (top == float("inf"))).any()))
            if self.records:
                self._record(key, step, top, g)
        if self.opens_steps and tops:  # every=None: each clip is a window (on every rank: flushes are collective)
            self.rec.open_step(step)
        if bad and bool(torch.stack([flag for _, flag in bad]).any()):  # one synchronization per step, and only here
            for key, flag in bad:
                if bool(flag):
                    site = self.rec.site_name(key)
                    self._warn_once(f"nonfinite:{site}", f"probe: qk_clip: a max logit at site {site!r} is not "
                                    f"finite (step {step}); that head is not clipped")

    def _record(self, key: SiteKey, step: int, top: Tensor, g: Tensor) -> None:
        fields = {
            "qk_clip_logit": torch.where(top > float("-inf"), top, float("nan")),
            "qk_clip_factor": g,
            "qk_clip_steps": (g < 1.0).float(),
        }
        with self.rec.lock:
            self.rec.acc.add(key, fields)

    def close(self) -> None:
        """Remove the optimizer hook (harmless twice); name every clippable site that optimizer
        steps came for but none that holds its weights (it was never clipped)."""
        for key in [k for k in self._top if k not in self._clipped and self._stepped]:
            found = None if key in self._unverified else self.sites.get(key)
            if isinstance(found, SiteProvenance):
                site = self.rec.site_name(key)
                names = ", ".join(f"{rows.name}.{rows.weight}" for rows in (found.q, found.k))
                self._warn_once(f"unheld:{site}", f"probe: qk_clip never clipped site {site!r}: no optimizer step "
                                f"that holds its q and k weights ({names}) came after its training forwards")
        self._stepped = False
        self._handle.remove()
        self.stop_mode()
        self._trace = None
        if self.rec.on_logit_max == self.on_call:
            self.rec.on_logit_max = None


class Riders:
    """What rides on a probe's capture mode: the first-forward audit (on sampled steps) and, with
    ``qk_clip``, the clip's provenance trace (above both) and its max-logit-only steps.

    The profiler calls :meth:`start` once the capture mode is entered, :meth:`stop` before it is
    left and :meth:`finish` after; :meth:`remove` (with the probe's other handles, at close)
    removes the clip's optimizer hook.

    Args:
        audit: the :class:`~probe.capture.audit_warning.FirstForwardAudit`.
        clip: the :class:`Clipping`, or ``None``.
        sampled: whether a step is sampled (its forwards get every statistic, not only max logits).
    """

    def __init__(self, audit: Any, clip: Optional[Clipping], sampled: Callable[[int], bool]) -> None:
        self.audit = audit
        self.clip = clip
        # weakly: the probe's finalizer holds its attributes, which must not lead back to the probe
        self._sampled = weakref.WeakMethod(sampled) if hasattr(sampled, "__self__") else (lambda: sampled)

    def __getattr__(self, name: str) -> Any:  # the audit's own attributes (events, done, ...)
        return getattr(self.__dict__["audit"], name)

    def measures(self) -> bool:
        """Whether a forward starting now is captured for QK-Clip (sampled or not)."""
        return self.clip is not None and self.clip.measures()

    def start(self, recorder: Recorder) -> None:
        sampled = self._sampled()
        recorder.max_logit_only = not (sampled is not None and sampled(recorder.step))  # QK-Clip's step only
        if not recorder.max_logit_only:
            self.audit.start(recorder)  # above the capture mode: it sees the model's ops first
        if self.clip is not None:
            self.clip.start()  # above the audit

    def stop(self) -> None:
        if self.clip is not None:
            self.clip.stop_mode()
        self.audit.stop()

    def finish(self, recorder: Recorder) -> None:
        self.audit.finish(recorder)
        if self.clip is not None:
            self.clip.end()

    def remove(self) -> None:
        if self.clip is not None:
            self.clip.close()
