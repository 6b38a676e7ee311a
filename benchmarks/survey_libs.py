"""Libraries the survey had not covered (the library survey of December): OpenAI Whisper, Microsoft
torchscale, and lucidrains' stand-alone attention libraries. Tiny configs from constructors, random
weights, no downloads; each library skipped when not installed. :func:`libs_cases` is yielded by
``survey_more.more_cases`` (``coverage_survey.py --only more``, ``--match libs/`` for these alone).

Installed here with ``pip install --no-deps`` (never letting pip touch torch), see docs/models.md.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

Case = Tuple[str, Callable[[], Tuple[nn.Module, tuple, dict]], Optional[Callable[[str, int], float]]]
B, L, VOCAB = 2, 8, 64


def _default(site: str, d: int) -> float:
    return d ** -0.5


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _ids(n: int = L, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (B, n), generator=_gen())


class _Call(nn.Module):
    """A model whose forward is ``fn(model)``: a library's own multi-step entry point (decoding
    with a KV cache, an encoder-decoder's two towers) as one forward the survey can run."""

    def __init__(self, model: nn.Module, fn: Callable[[nn.Module], Any]) -> None:
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self) -> Any:
        return self.fn(self.model)


# -- OpenAI Whisper --------------------------------------------------------------------------------
def _whisper(sdpa: bool, mode: str) -> Tuple[nn.Module, tuple, dict]:
    """Whisper at tiny sizes. Eager (``use_sdpa = False``): ``(q * d**-0.25) @ (k * d**-0.25)ᵀ``,
    the causal mask added, softmax in float32. ``mode``: ``full`` (encoder and decoder, the
    decoder's cross-attention to the audio), ``cache`` (the decoder with its KV-cache hooks, two
    steps: the second a single token against the cached keys)."""
    import whisper.model as wm

    wm.MultiHeadAttention.use_sdpa = sdpa
    torch.manual_seed(0)
    dims = wm.ModelDimensions(n_mels=8, n_audio_ctx=8, n_audio_state=32, n_audio_head=4, n_audio_layer=2,
                              n_vocab=VOCAB, n_text_ctx=16, n_text_state=32, n_text_head=4, n_text_layer=2)
    model = wm.Whisper(dims).eval()
    g = _gen()
    mel = torch.randn(B, 8, 16, generator=g)  # conv stride 2: 8 audio positions
    tokens = torch.randint(0, VOCAB, (B, 6), generator=g)
    if mode == "full":
        return model, (mel, tokens), {}

    def decode(m: nn.Module) -> torch.Tensor:
        cache, hooks = m.install_kv_cache_hooks()
        try:
            audio = m.embed_audio(mel)
            first = m.decoder(tokens, audio, kv_cache=cache)
            step = m.decoder(tokens[:, -1:], audio, kv_cache=cache)
        finally:
            for h in hooks:
                h.remove()
        return first.sum() + step.sum()

    return _Call(model, decode), (), {}


# -- torchscale ------------------------------------------------------------------------------------
def _import_torchscale() -> None:
    """Import torchscale's architectures with stand-ins for two imports it makes at module level:
    ``fairscale.nn``'s ``checkpoint_wrapper`` / ``wrap`` (used only with ``checkpoint_activations`` /
    ``fsdp``, off here) and ``timm.models.layers.drop_path`` (``drop_path_rate`` 0 here). fairscale
    is not installed on purpose: its wheel ships a top-level ``benchmarks`` package that shadows
    this repository's (a namespace package); timm needs torchvision. The stand-ins leave
    ``sys.modules`` once torchscale holds what it took from them."""
    stubs: Dict[str, types.ModuleType] = {}
    if importlib.util.find_spec("fairscale") is None:
        fs, fsnn = types.ModuleType("fairscale"), types.ModuleType("fairscale.nn")
        fsnn.checkpoint_wrapper = fsnn.wrap = lambda module, *a, **k: module  # type: ignore[attr-defined]
        fs.nn = fsnn  # type: ignore[attr-defined]
        stubs.update({"fairscale": fs, "fairscale.nn": fsnn})
    if "timm" not in sys.modules and importlib.util.find_spec("timm") is None:
        names = ("timm", "timm.models", "timm.models.layers")
        mods = {n: types.ModuleType(n) for n in names}
        mods["timm.models.layers"].drop_path = lambda x, p=0.0, training=False: x  # type: ignore[attr-defined]
        stubs.update(mods)
    sys.modules.update(stubs)
    try:
        import torchscale.architecture.decoder  # noqa: F401
        import torchscale.architecture.encoder  # noqa: F401
        import torchscale.architecture.encoder_decoder  # noqa: F401
        import torchscale.architecture.retnet  # noqa: F401
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


def _torchscale(kind: str) -> Tuple[nn.Module, tuple, dict]:
    """torchscale's Encoder / Decoder / EncoderDecoder (``q *= scaling`` in place, ``bmm`` over heads
    folded into the batch, key padding as ``masked_fill(-inf)``, relative position buckets as a
    bias, xPos on q and k, the decoder's ``incremental_state`` cache)."""
    _import_torchscale()
    from torchscale.architecture.config import DecoderConfig, EncoderConfig, EncoderDecoderConfig

    torch.manual_seed(0)
    size = dict(vocab_size=VOCAB)
    enc = dict(encoder_embed_dim=32, encoder_attention_heads=4, encoder_ffn_embed_dim=64, encoder_layers=2)
    dec = dict(decoder_embed_dim=32, decoder_attention_heads=4, decoder_ffn_embed_dim=64, decoder_layers=2)
    ids = _ids()
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, -3:] = True
    if kind.startswith("encoder") and kind != "encoder_decoder":
        from torchscale.architecture.encoder import Encoder

        extra = {"rel": dict(rel_pos_buckets=8, max_rel_pos=16), "xpos": dict(xpos_rel_pos=True),
                 "multiway": dict(multiway=True)}.get(kind.split("_", 1)[-1], {})
        model = Encoder(EncoderConfig(**enc, **size, **extra), embed_tokens=nn.Embedding(VOCAB, 32)).eval()
        kwargs: Dict[str, Any] = {"encoder_padding_mask": pad}
        if "multiway" in kind:
            kwargs["multiway_split_position"] = 3
        return model, (ids,), kwargs
    if kind.startswith("decoder"):
        from torchscale.architecture.decoder import Decoder

        extra = {"rel": dict(rel_pos_buckets=8, max_rel_pos=16), "xpos": dict(xpos_rel_pos=True)}.get(
            kind.split("_", 1)[-1], {})
        model = Decoder(DecoderConfig(**dec, **size, **extra), embed_tokens=nn.Embedding(VOCAB, 32),
                        output_projection=nn.Linear(32, VOCAB)).eval()
        if kind.endswith("cache"):
            def decode(m: nn.Module) -> torch.Tensor:
                state: Dict[int, Dict[str, torch.Tensor]] = {}
                total = torch.zeros(())
                for t in range(1, 4):
                    out, _ = m(ids[:, :t], incremental_state=state)
                    total = total + out.sum()
                return total

            return _Call(model, decode), (), {}
        return model, (ids,), {}
    from torchscale.architecture.encoder_decoder import EncoderDecoder

    model = EncoderDecoder(EncoderDecoderConfig(**enc, **dec, **size), encoder_embed_tokens=nn.Embedding(VOCAB, 32),
                           decoder_embed_tokens=nn.Embedding(VOCAB, 32),
                           output_projection=nn.Linear(32, VOCAB)).eval()
    return model, (ids, ids[:, :6]), {"encoder_padding_mask": pad}


def _retnet() -> Tuple[nn.Module, tuple, dict]:
    """RetNet (retention: ``(q kᵀ ⊙ decay) v``, normalized by the row's absolute sum, no softmax):
    not softmax attention; probe must not report it as measured attention."""
    _import_torchscale()
    from torchscale.architecture.config import RetNetConfig
    from torchscale.architecture.retnet import RetNetDecoder

    torch.manual_seed(0)
    cfg = RetNetConfig(decoder_embed_dim=32, decoder_value_embed_dim=32, decoder_retention_heads=2,
                       decoder_ffn_embed_dim=64, decoder_layers=2, vocab_size=VOCAB)
    model = RetNetDecoder(cfg, embed_tokens=nn.Embedding(VOCAB, 32), output_projection=nn.Linear(32, VOCAB)).eval()
    return model, (_ids(),), {}


def libs_cases(have: Callable[[str], bool]) -> Iterator[Case]:
    """The cases of the libraries above that are installed (``have`` prints the skipped ones)."""
    if have("whisper"):
        for sdpa in (False, True):
            for mode in ("full", "cache"):
                yield (f"libs/whisper/{'sdpa' if sdpa else 'eager'}_{mode}",
                       lambda s=sdpa, m=mode: _whisper(s, m), _default)
    if have("torchscale"):
        for kind in ("encoder", "encoder_rel", "encoder_xpos", "encoder_multiway", "decoder", "decoder_rel",
                     "decoder_xpos", "decoder_cache", "encoder_decoder"):
            yield f"libs/torchscale/{kind}", lambda k=kind: _torchscale(k), None if "xpos" in kind else _default
        yield "libs/torchscale/retnet", _retnet, None
