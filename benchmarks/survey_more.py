"""More libraries for the coverage survey (issue 25), and its check by values.

Libraries people train with that the survey did not cover (tiny configs, random weights, no hub
downloads; each skipped when not installed):

- diffusers: ``UNet2DConditionModel`` (self- and cross-attention in its transformer blocks) with
  the default ``AttnProcessor2_0`` (SDPA) and the eager ``AttnProcessor`` (``baddbmm`` with the
  scale, softmax, ``bmm``, heads folded into the batch), and ``DiTTransformer2DModel``;
- peft: LoRA adapters on Hugging Face Llama (sdpa and eager) and BERT, base model frozen; LoRA on
  GPT-2's fused ``c_attn`` (``Conv1D``), DoRA and rsLoRA on every attention projection of Llama,
  IA3 on Llama's k and v;
- fair-esm: ESM-2 (its own multi-head attention: q scaled, rotary embeddings, ``bmm`` over
  heads folded into the batch);
- perceiver-pytorch: Perceiver (latent cross- and self-attention, ``einsum``);
- flamingo-pytorch: the perceiver resampler and gated cross-attention;
- reformer-pytorch: Reformer (LSH attention in buckets, full attention for short inputs).

:func:`values` is the survey's check by values: an independent forward (the model in eval, the
same inputs) under a mode that records, per site (the innermost module, named as probe names
sites), every softmax over the last dim and every SDPA call, and computes in float64 what the
model computed: the mean normalized entropy and max probability of its own probabilities
(eager; for ``nn.MultiheadAttention`` its per-head weights, ``need_weights=True``), and for SDPA,
from its own arguments, the same at ``actual`` and, with the scale the model's config declares,
at ``unscaled`` and ``standard``. Keys with probability below 1e-30 (about e^-69) count as
masked; probe may also match the reading in which only keys a mask removes (a softmax input or
bias at or below -1e4) count as masked, for logits that spread beyond 69 without a mask.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

Case = Tuple[str, Callable[[], Tuple[nn.Module, tuple, dict]], Optional[Callable[[str, int], float]]]
B, L, VOCAB = 2, 8, 64


def _default(site: str, d: int) -> float:
    return d ** -0.5


# -- the cases -------------------------------------------------------------------------------------
def _unet(eager: bool) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                 attention_head_dim=8, norm_num_groups=8).eval()
    if eager:
        from diffusers.models.attention_processor import AttnProcessor

        model.set_attn_processor(AttnProcessor())
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(1, 4, 8, 8, generator=g), 3), {"encoder_hidden_states": torch.randn(1, 5, 32, generator=g)}


def _dit() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                  num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                  norm_num_groups=8).eval()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(1, 4, 8, 8, generator=g),), {"timestep": torch.tensor([3]),
                                                             "class_labels": torch.tensor([1])}


def _peft(arch: str, impl: str, variant: str = "lora") -> Tuple[nn.Module, tuple, dict]:
    import transformers as tr
    from peft import IA3Config, LoraConfig, get_peft_model

    torch.manual_seed(0)
    if arch == "llama":
        config = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=64, attn_implementation=impl)
        base, targets = tr.LlamaForCausalLM(config), ["q_proj", "v_proj"]
    elif arch == "gpt2":
        config = tr.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, attn_implementation=impl)
        base, targets = tr.GPT2LMHeadModel(config), ["c_attn"]
    else:
        config = tr.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, attn_implementation=impl)
        base, targets = tr.BertModel(config), ["query", "value"]
    if variant == "ia3":
        adapter = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    else:
        options = {"dora": {"use_dora": True}, "rslora": {"use_rslora": True}}.get(variant, {})
        if variant != "lora":
            targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        adapter = LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=arch == "gpt2", **options)
    model = get_peft_model(base, adapter).eval()
    with torch.no_grad():  # trained adapters: B (zero at init) and IA3's vectors (one at init) away from it
        for name, p in model.named_parameters():
            if "lora_B" in name or "ia3_l" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.2)
    ids = torch.randint(3, VOCAB, (B, L), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids}


def _esm() -> Tuple[nn.Module, tuple, dict]:
    import esm

    torch.manual_seed(0)
    model = esm.model.esm2.ESM2(num_layers=2, embed_dim=32, attention_heads=4,
                                alphabet=esm.Alphabet.from_architecture("ESM-1b"), token_dropout=False).eval()
    return model, (torch.randint(4, 24, (B, L), generator=torch.Generator().manual_seed(1)),), {}


def _perceiver() -> Tuple[nn.Module, tuple, dict]:
    from perceiver_pytorch import Perceiver

    torch.manual_seed(0)
    model = Perceiver(input_channels=3, input_axis=2, num_freq_bands=4, max_freq=10.0, depth=2, num_latents=8,
                      latent_dim=32, cross_heads=1, latent_heads=4, cross_dim_head=8, latent_dim_head=8,
                      num_classes=10).eval()
    return model, (torch.randn(1, 6, 6, 3, generator=torch.Generator().manual_seed(1)),), {}


class _Flamingo(nn.Module):
    """flamingo-pytorch's two attention blocks: a perceiver resampler over media tokens, then a
    gated cross-attention of text onto them."""

    def __init__(self) -> None:
        super().__init__()
        from flamingo_pytorch import GatedCrossAttentionBlock, PerceiverResampler

        self.resampler = PerceiverResampler(dim=32, depth=2, dim_head=8, heads=4, num_latents=4)
        self.xattn = GatedCrossAttentionBlock(dim=32, dim_head=8, heads=4)
        with torch.no_grad():
            for name, p in self.xattn.named_parameters():
                if "gate" in name:
                    p.fill_(0.5)  # open the tanh gates (0 at init), so the attention takes part

    def forward(self, text: Tensor, media: Tensor) -> Tensor:
        latents = self.resampler(media)
        media_locations = torch.zeros(text.shape[:2], dtype=torch.bool)
        media_locations[:, 0] = True
        return self.xattn(text, latents, media_locations=media_locations)


def _flamingo() -> Tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _Flamingo().eval(), (torch.randn(B, L, 32, generator=g), torch.randn(B, 1, 6, 32, generator=g)), {}


def _reformer(lsh: bool) -> Tuple[nn.Module, tuple, dict]:
    from reformer_pytorch import ReformerLM

    torch.manual_seed(0)
    model = ReformerLM(num_tokens=VOCAB, dim=32, depth=2, heads=4, dim_head=8, max_seq_len=32, bucket_size=4,
                       n_hashes=2, causal=True, use_full_attn=not lsh, lsh_dropout=0.0, ff_dropout=0.0,
                       post_attn_dropout=0.0, layer_dropout=0.0).train()  # its reversible backward needs train()
    return model, (torch.randint(0, VOCAB, (B, 16), generator=torch.Generator().manual_seed(1)),), {}


def more_cases() -> Iterator[Case]:
    """The survey's cases from the libraries above that are installed."""
    import importlib.util

    def have(name: str) -> bool:
        if importlib.util.find_spec(name) is None:
            print(f"{name} not installed: skipped")
            return False
        return True

    if have("diffusers"):
        yield "diffusers/unet/sdpa", lambda: _unet(False), _default
        yield "diffusers/unet/eager", lambda: _unet(True), _default
        yield "diffusers/dit", _dit, _default
    if have("peft"):
        for arch in ("llama", "bert"):
            for impl in ("sdpa", "eager"):
                yield f"peft/lora_{arch}/{impl}", lambda a=arch, i=impl: _peft(a, i), _default
        yield "peft/lora_gpt2/eager", lambda: _peft("gpt2", "eager"), _default
        for variant in ("dora", "rslora", "ia3"):
            yield f"peft/{variant}_llama/sdpa", lambda v=variant: _peft("llama", "sdpa", v), _default
    if have("esm"):
        yield "fair-esm/esm2", _esm, _default
    if have("perceiver_pytorch"):
        yield "perceiver-pytorch/perceiver", _perceiver, _default
    if have("flamingo_pytorch"):
        yield "flamingo-pytorch/resampler_xattn", _flamingo, _default
    if have("reformer_pytorch"):
        yield "reformer-pytorch/full", lambda: _reformer(False), _default
        yield "reformer-pytorch/lsh", lambda: _reformer(True), _default
    from benchmarks.survey_libs import libs_cases
    from benchmarks.survey_sweep import sweep_cases

    yield from sweep_cases(have)
    yield from libs_cases(have)


# -- the check by values -----------------------------------------------------------------------------
_FUNCTION_MODULES = (nn.Softmax, nn.LogSoftmax, nn.Dropout, nn.Identity)
_TINY = 1e-30  # a key below this probability counts as masked (e^-69)
#: ``actual~``: the same probabilities with only the keys a mask removes (a softmax input or SDPA
#: bias at or below -1e4: -inf, a finfo.min fill) counted as masked. A model whose own logits
#: spread beyond 69 (visformer at random init: gaps of 8000) has unmasked keys below 1e-30; probe
#: counts them valid, as it should, and matches this one. Either reading passes (:func:`compare`).
_UNMASKED = -1e4


def _stats(p: Tensor, tau: float = 0.99, valid: Optional[Tensor] = None) -> Tuple[float, float, float, int]:
    """(Σ normalized entropy, Σ max prob, Σ saturated, rows) over rows with >= 2 valid keys
    (``valid``: the keys no mask removes; by default those of probability above 1e-30)."""
    valid = p > _TINY if valid is None else valid.broadcast_to(p.shape)
    p, valid = p.double().reshape(-1, p.shape[-1]), valid.reshape(-1, p.shape[-1])
    n = valid.sum(-1)
    ok = (n >= 2) & torch.isfinite(p).all(-1)
    if not ok.any():
        return 0.0, 0.0, 0.0, 0
    p, valid, n = p[ok], valid[ok], n[ok]
    pos = valid & (p > 0)  # an unmasked key of probability 0 (underflow) adds nothing
    ent = -(torch.where(pos, p * torch.log(torch.where(pos, p, 1.0)), 0.0)).sum(-1) / torch.log(n.double())
    top = p.amax(-1)
    return float(ent.sum()), float(top.sum()), float((top >= tau).sum()), int(ok.sum())


def _unmasked_inputs(logits: Any) -> Any:
    """The keys of a softmax input that no mask fill removes (above half the dtype's most
    negative value: docs/metrics.md): a score itself may be below -1e4 (Visformer's reach -6e4
    at random init), so only a fill marks a key masked here."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        return None
    return logits.detach() > torch.finfo(logits.dtype).min / 2


def _without_masked_rows(logits: Any, probs: Tensor) -> Tensor:
    """``probs`` with NaN on rows whose every softmax input is masked (``-inf``, at most half the
    dtype's most negative value or -1e9: Hugging Face's eager left-padded query rows, which it
    spreads uniformly; or all equal, once the row's max was subtracted): such a row has no valid
    key (docs/metrics.md) and ``_stats`` skips it."""
    if not isinstance(logits, Tensor) or logits.shape != probs.shape or not logits.is_floating_point():
        return probs
    # a fill of -1e9 or below (LongT5's -1e10 on the query rows it pads to a block) masks a row
    # as surely as finfo.min; no score reaches it (Visformer's reach -6e4)
    fill = max(torch.finfo(logits.dtype).min / 2, -1e9)
    masked = (logits <= fill).all(-1, keepdim=True)
    # every input equal: such a row after ``x - x.max(-1)`` (MiMo-V2-Flash), which zeroes a fully
    # masked row's fills; exact ties across a whole row of real scores do not happen
    masked |= (logits == logits[..., :1]).all(-1, keepdim=True) & (logits.shape[-1] > 1)
    return probs.masked_fill(masked, math.nan) if bool(masked.any()) else probs


def _sdpa_probs(args: tuple, kwargs: dict, scale_of: Callable[[float, int], Optional[Tuple[float, float]]]
                ) -> Dict[str, Tensor]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    b = dict(zip(names, args))
    b.update(kwargs)
    q, k = b["query"].double(), b["key"].double()
    if q.shape[-3] != k.shape[-3] and q.dim() >= 4:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    d = q.shape[-1]
    scale = b.get("scale") if b.get("scale") is not None else 1 / math.sqrt(d)
    raw = q @ k.transpose(-1, -2)
    bias = torch.zeros_like(raw)
    mask = b.get("attn_mask")
    if isinstance(mask, Tensor):
        bias = bias + (torch.where(mask, 0.0, -math.inf) if mask.dtype == torch.bool else mask.double())
    if b.get("is_causal"):
        keep = torch.ones(raw.shape[-2], raw.shape[-1], dtype=torch.bool).tril()
        bias = bias.masked_fill(~keep, -math.inf)
    out = {"actual": torch.softmax(scale * raw + bias, -1), "actual~": (torch.softmax(scale * raw + bias, -1),
                                                                      bias > _UNMASKED)}
    true = scale_of(scale, d)  # (the model's declared scale, standard) or None
    if true is not None:
        declared, standard = true
        r = scale * raw / declared  # q·kᵀ without the model's scale
        out["unscaled"] = torch.softmax(r + bias, -1)
        out["standard"] = torch.softmax(standard * r + bias, -1)
        # at a counterfactual scale the logits may spread beyond 69 (MobileBERT unscaled): keys
        # below 1e-30 that no mask removes are valid, as at ``actual~``
        out["unscaled~"] = (out["unscaled"], bias > _UNMASKED)
        out["standard~"] = (out["standard"], bias > _UNMASKED)
    return out


class _ValueMode(TorchFunctionMode):
    def __init__(self, stack: List[str], found: Dict[Tuple[str, int], Dict[str, List[float]]],
                 counters: Dict[int, int], scale_of: Callable[[float, int], Optional[Tuple[float, float]]]) -> None:
        super().__init__()
        self.stack, self.found, self.counters, self.scale_of = stack, found, counters, scale_of

    def _add(self, probs: Dict[str, Tensor]) -> None:
        name = self.stack[-1] if self.stack else "root"
        key = id(self.stack) if not self.stack else hash(tuple(self.stack))
        index = self.counters.get(key, 0)
        self.counters[key] = index + 1
        entry = self.found.setdefault((name, index), {})
        for scale, p in probs.items():
            sums = entry.setdefault(scale, [0.0, 0.0, 0.0, 0])
            for i, v in enumerate(_stats(p[0], valid=p[1]) if isinstance(p, tuple) and p[1] is not None
                                  else _stats(p[0] if isinstance(p, tuple) else p)):
                sums[i] += v

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            self._add(_sdpa_probs(args, kwargs, self.scale_of))
        elif func is F.multi_head_attention_forward:  # nn.MultiheadAttention: its own per-head weights
            again = dict(kwargs, need_weights=True, average_attn_weights=False)
            weights = func(*args, **again)[1]
            if isinstance(weights, Tensor):
                self._add({"actual": weights.detach()})
        elif func in (F.softmax, torch.softmax, Tensor.softmax) and isinstance(out, Tensor) and out.dim() >= 3:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim in (-1, out.dim() - 1) and out.is_floating_point():
                self._add({"actual": _without_masked_rows(args[0], out.detach()),
                           "actual~": (out.detach(), _unmasked_inputs(args[0]))})
        return out


def values(model: nn.Module, args: tuple, kwargs: dict,
           expected: Optional[Callable[[str, int], float]]) -> Dict[str, Dict[str, Tuple[float, float, float]]]:
    """site -> scale -> (mean normalized entropy, mean max prob, saturation) of what the model
    computed (module docstring). Sites named as probe names them (``name#n`` for several calls
    in one invocation)."""
    from probe.capture.sites import site_names

    names = site_names(model)
    stack: List[str] = []
    found: Dict[Tuple[str, int], Dict[str, List[float]]] = {}
    counters: Dict[int, int] = {}
    current = ["root"]

    def push(module: nn.Module, inputs: Any) -> None:
        name = names.get(id(module))
        if name is not None and not isinstance(module, _FUNCTION_MODULES):
            stack.append(name)
            counters[hash(tuple(stack))] = 0

    def pop(module: nn.Module, inputs: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is not None and not isinstance(module, _FUNCTION_MODULES) and stack and stack[-1] == name:
            stack.pop()

    def scale_of(used: float, d: int) -> Optional[Tuple[float, float]]:
        site = stack[-1] if stack else current[0]
        return None if expected is None else (expected(site, d), d ** -0.5)

    handles = [nn.modules.module.register_module_forward_pre_hook(push),
               nn.modules.module.register_module_forward_hook(pop, always_call=True)]
    try:
        # grad on, as the watched forward it is compared with runs (coverage_survey._watch_warnings):
        # SDPA may take another kernel without it, and a model whose logits reach 1e4 (Visformer at
        # random init) carries that rounding into its next layers' near one-hot softmax
        with torch.enable_grad(), _ValueMode(stack, found, counters, scale_of):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    multi = {name for name, index in found if index > 0}
    out: Dict[str, Dict[str, Tuple[float, float, float]]] = {}
    for (name, index), by_scale in found.items():
        site = f"{name}#{index + 1}" if name in multi else name
        out[site] = {scale: (e / n, m / n, s / n) for scale, (e, m, s, n) in by_scale.items() if n}
    return out


def compare(summary: Any, oracle: Dict[str, Dict[str, Tuple[float, float, float]]], rtol: float = 1e-4
            ) -> Dict[str, List[str]]:
    """site -> what differs between probe's summary and the model's own computation (head means
    of entropy, max_prob, saturation at each scale the oracle has), beyond ``rtol`` relative or
    ``rtol·1e-2`` absolute: a near one-hot softmax of logits in the tens of thousands (Visformer at
    random init) has an entropy near 5e-4 that float32 logits round by about 1e-3 of itself: there
    the model's own float32 softmax is 3.9e-4 of it from a float64 computation, probe 5.3e-4, and
    the two 8.7e-4 apart."""
    problems: Dict[str, List[str]] = {}
    for site, by_scale in oracle.items():
        if site not in summary.sites:
            continue
        metrics = summary.metrics(site)
        for scale, (ent, top, sat) in by_scale.items():
            if scale.endswith("~"):
                continue
            alt = by_scale.get(scale + "~")
            for i, (metric, want) in enumerate((("entropy", ent), ("max_prob", top), ("saturation", sat))):
                if metric not in metrics or scale not in summary.scales(site, metric):
                    continue
                got = float(summary.value(site, metric, scale).mean())
                wants = (want,) if alt is None else (want, alt[i])
                if not any(abs(got - w) <= rtol * max(abs(w), 1e-2) for w in wants):
                    problems.setdefault(site, []).append(f"{metric}@{scale} {got:.6g} != model's {want:.6g}")
    return problems
