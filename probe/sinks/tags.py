"""TensorBoard tag names, in one place: the TensorBoard sink writes them, ``probe check`` reads them.

TensorBoard groups tags by their first path component and sorts groups by name; its Time Series
tab opens with the first two groups expanded and the others collapsed. So the headline comes
first, in a group of its own (``attention``, which sorts before ``loss`` and ``probe.*``), and each
metric at each scale is a group of its own, spelt as thresholds spell it (``probe.entropy@actual``,
``probe.entropy@unscaled``): what the model does is never in the same group as a counterfactual.

=================  ==================================================  ==============================
plugin             tag                                                 content
=================  ==================================================  ==============================
scalar             ``attention/{metric}`` for entropy, logit_max,      every head of every site at
                   saturation                                          ``actual``: mean (max for
                                                                       ``logit_max``)
scalar             ``probe.{metric}@{scale}/{site}``                   head mean (max for
                                                                       ``logit_max``, sum for
                                                                       ``nonfinite``)
scalar             ``probe.{metric}@{scale}/{site}/head{h:02d}``       one head (``per_head=True``)
image              ``probe.{metric}.heatmap/{scale}``                  sites × heads heatmap
histogram          ``probe.{metric}.hist/{scale}``                     all heads of all sites
custom scalars     category ``attention``: the loss (any tag with      loss and the headline
                   ``loss`` in it) and the ``attention/*`` charts
custom scalars     category ``probe.{metric}``, a chart a site         actual as a line in a band
                                                                       from standard to unscaled
                                                                       (a Margin chart)
text               ``probe.sites``                                     the detected sites
=================  ==================================================  ==============================

Site and scale names are encoded in tags (:func:`probe.names.encode_name`): ``%``, ``/`` and
control characters become ``%XX``, so ``a/head03`` stays one site and a newline cannot break a
writer; reading a tag back decodes the raw name, which the summary keeps. Runs written by earlier
versions (``probe.{metric}/{scale}/{site}``, and ``probe/{metric}/{scale}/{site}`` before it) are
read too.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

from probe.names import decode_name, encode_name, printable

__all__ = [
    "OVERVIEW", "OVERVIEW_METRICS", "SITES_TAG", "ScalarTag", "category", "custom_scalars_layout", "decode_name",
    "encode_name", "heatmap_tag", "histogram_tag", "overview_tag", "parse_scalar_tag", "printable", "scalar_tag",
    "scale_label",
]

PREFIX = "probe."
#: The headline group: the first one TensorBoard's Time Series opens, and the first Custom
#: Scalars category.
OVERVIEW = "attention"
#: The metrics of the headline, at the model's own scale (``actual``).
OVERVIEW_METRICS = ("entropy", "logit_max", "saturation")
#: The Custom Scalars chart of the loss: every scalar whose tag has ``loss`` in it (any case), in
#: any run of the log directory (the demo's ``loss/train``, a trainer's ``train/loss``).
LOSS_REGEX = r"(?i).*loss"
#: The text summary holding the table of detected sites.
SITES_TAG = "probe.sites"

_HEAD = re.compile(r"head(\d+)")


@functools.lru_cache(maxsize=1 << 16)  # the same few hundred tags at every flush
def scalar_tag(metric: str, scale: str, site: str, head: Optional[int] = None) -> str:
    """``probe.{metric}@{scale}/{site}``, or ``.../head{h:02d}`` for one head (names encoded)."""
    tag = f"{group(metric, scale)}/{encode_name(site)}"
    return tag if head is None else f"{tag}/head{head:02d}"


def group(metric: str, scale: str) -> str:
    """The TensorBoard group of a metric at one scale: ``probe.{metric}@{scale}``."""
    return f"{PREFIX}{metric}@{encode_name(scale)}"


def overview_tag(metric: str) -> str:
    """``attention/{metric}``: one of the headline scalars (:data:`OVERVIEW_METRICS`)."""
    return f"{OVERVIEW}/{metric}"


def heatmap_tag(metric: str, scale: str) -> str:
    return f"{PREFIX}{metric}.heatmap/{encode_name(scale)}"


def histogram_tag(metric: str, scale: str) -> str:
    return f"{PREFIX}{metric}.hist/{encode_name(scale)}"


def category(metric: str) -> str:
    """The custom-scalars category of a metric (the same name as its scalar group)."""
    return f"{PREFIX}{metric}"


#: The scales of a Margin chart: (line, band edge, band edge).
BAND = ("actual", "standard", "unscaled")


def custom_scalars_layout(metric_sites: Mapping[str, List[str]],
                          scales: Optional[Mapping[Tuple[str, str], Iterable[str]]] = None) -> Dict[str, Dict[str, List[Any]]]:
    """The ``SummaryWriter.add_custom_scalars`` layout: first the headline category
    (:data:`OVERVIEW`: the loss, then the ``attention/*`` scalars), then one category per metric,
    one chart per site.

    A site with the three built-in scales of a metric (``scales[(metric, site)]``) gets a Margin
    chart: ``actual`` as a line in a band from ``standard`` to ``unscaled``, each in its run's
    colour (TensorBoard colours by run, so a Multiline chart of the three could tell the scales
    apart by marker shape only). Extra named scales add a Multiline chart of every scale
    (``{site}: every scale``); a metric with fewer scales (``grad_q``: actual only) gets the
    Multiline chart alone. Without ``scales``, Multiline charts only.

    Pitfall: the Multiline regex escapes site names (``.``, ``#``) and ends in ``$``, so the
    ``/headNN`` scalars of ``per_head=True`` stay out of the chart.
    """
    layout: Dict[str, Dict[str, List[Any]]] = {OVERVIEW: {"loss (every tag with 'loss' in it)": ["Multiline", [LOSS_REGEX]]}}
    for metric in OVERVIEW_METRICS:
        if metric in metric_sites:
            layout[OVERVIEW][f"{metric} at actual, {'max' if metric == 'logit_max' else 'mean'} of every head"] = [
                "Multiline", [f"^{re.escape(overview_tag(metric))}$"]]
    for metric, sites in metric_sites.items():
        charts = layout.setdefault(category(metric), {})
        shown = [printable(site) for site in sites]
        for site, title in zip(sites, shown):
            if shown.count(title) > 1:  # printed alike ("a\nb", "a\\nb"): the tag's encoding tells them apart
                title = encode_name(site)
            have = set(scales.get((metric, site), ())) if scales is not None else set()
            multiline = ["Multiline", [f"^{re.escape(category(metric))}@[^/]+/{re.escape(encode_name(site))}$"]]
            if not set(BAND) <= have:
                charts[title] = multiline
                continue
            charts[f"{title}: actual, band standard–unscaled"] = [
                "Margin", [scalar_tag(metric, scale, site) for scale in BAND]]
            if have - set(BAND):
                charts[f"{title}: every scale"] = multiline
    return layout


class ScalarTag(NamedTuple):
    metric: str
    scale: str
    site: str
    head: Optional[int]  # None: the head aggregate


def _head(part: str) -> Optional[int]:
    match = _HEAD.fullmatch(part)
    return int(match.group(1)) if match else None


def parse_scalar_tag(tag: str) -> Optional[ScalarTag]:
    """The parts of a probe scalar tag, names decoded; None for any other tag (the headline
    ``attention/*`` scalars included: they repeat what the per-site tags hold).

    Also reads the tags of earlier probe versions: ``probe.{metric}/{scale}/{site}[/headNN]`` and
    ``probe/{metric}/{scale}/{site}[/headNN]`` (names not encoded there: a site containing ``/`` is
    ambiguous and read as written).
    """
    parts = tag.split("/")
    first = parts[0][len(PREFIX):] if parts[0].startswith(PREFIX) else None
    if first is not None and "@" in first and len(parts) in (2, 3):
        metric, scale = first.split("@", 1)
        if not metric or "." in metric or not scale:
            return None
        head = _head(parts[2]) if len(parts) == 3 else None
        if len(parts) == 3 and head is None:
            return None
        return ScalarTag(metric, decode_name(scale), decode_name(parts[1]), head)
    if first is not None and len(parts) in (3, 4) and "." not in first and "@" not in first:
        head = _head(parts[3]) if len(parts) == 4 else None
        if len(parts) == 4 and head is None:
            return None
        return ScalarTag(first, decode_name(parts[1]), decode_name(parts[2]), head)
    if parts[0] == "probe" and len(parts) >= 4:  # the old layout
        rest, head = parts[3:], None
        match = _HEAD.fullmatch(rest[-1]) if len(rest) > 1 else None
        if match:
            head, rest = int(match.group(1)), rest[:-1]
        return ScalarTag(parts[1], parts[2], "/".join(rest), head)
    return None


def scale_label(scale: Any, d_k: Any = None) -> str:
    """An attention scale for people: ``1/√128`` when it is ``1/sqrt(d_k)``, ``1`` unscaled,
    else the number; ``per-head [...]`` for head-wise scales."""
    if scale is None:
        return "unknown"
    if isinstance(scale, list):
        if scale and all(abs(s - scale[0]) <= 1e-6 * abs(scale[0]) for s in scale):
            return scale_label(scale[0], d_k)
        return "per-head [" + ", ".join(f"{s:.4g}" for s in scale) + "]"
    if isinstance(d_k, int) and d_k > 0 and scale > 0:
        for root in (d_k, 2 * d_k):  # 1/sqrt(d_k); 1/sqrt(2 d_k) is DeBERTa's
            if abs(scale * root**0.5 - 1) < 1e-5:
                return f"1/√{root}"
    return f"{scale:.6g}"
