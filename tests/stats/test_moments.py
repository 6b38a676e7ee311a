"""The centred path (probe.stats.paths.centred) against float64 references of the model's own logits.

Every mask kind it takes (none, key padding as a broadcast row or as Hugging Face's full
``(B, 1, L, S)`` mask, causal, causal with key padding), grouped-query attention, ``L != S``,
tiny shapes, fully padded rows, and adversarial inputs whose logits have a mean ~1e5 times their
spread (float32 logits lose most of it; the row shift here is float64).
"""

from __future__ import annotations

import math

import pytest
import torch

from probe.call import AttentionCall
from probe.stats import buffers, chunks, masks, plan
from probe.stats.forward import forward_stats
from probe.stats.paths import centred, key_blocks
from tests.helpers import masked_logits64


def _reference(call: AttentionCall, key_mask, scale: float):
    z, valid = masked_logits64(call.q, call.k, scale, call.causal, key_mask)
    heads = z.shape[1]
    out = {"count": [], "mean": [], "var": [], "max": [], "entropy": [], "max_prob": []}
    for h in range(heads):
        v = z[:, h][valid[:, h]]
        out["count"].append(float(v.numel()))
        out["mean"].append(float(v.mean()) if v.numel() else 0.0)
        out["var"].append(float(v.var(unbiased=False)) if v.numel() else math.nan)
        out["max"].append(float(v.max()) if v.numel() else -math.inf)
        zh = z[:, h].masked_fill(~valid[:, h], -math.inf)
        rows = valid[:, h].sum(-1) >= 2  # entropy and max_prob count rows with two keys or more
        p = torch.softmax(zh[rows], -1)
        ent = -(p * torch.log(p.clamp(min=1e-300))).sum(-1) / torch.log(valid[:, h].sum(-1)[rows].double())
        out["entropy"].append(float(ent.sum()))
        out["max_prob"].append(float(p.amax(-1).sum()))
    return {key: torch.tensor(v, dtype=torch.float64) for key, v in out.items()}


def _inputs(b=2, h=4, hk=2, l=40, s=40, d=8, mean=0.0, noise=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = mean + noise * torch.randn(b, h, l, d, generator=g)
    k = mean + noise * torch.randn(b, hk, s, d, generator=g)
    return q, k


def _mask(kind: str, b: int, l: int, s: int):
    """(call mask, key mask for the reference)."""
    keys = torch.ones(b, 1, 1, s, dtype=torch.bool)
    keys[-1, ..., s - s // 3 :] = False  # the last batch row: its last third is padding
    if kind == "none":
        return None, None
    if kind == "row":  # a broadcast row
        return keys, keys
    if kind == "full":  # Hugging Face: the padding expanded to (B, 1, L, S)
        return keys.expand(b, 1, l, s).clone(), keys
    raise ValueError(kind)


@pytest.fixture(params=["chunks", "key blocks"])
def path(request, monkeypatch):
    """Each centred-path test on both variants: chunks of query rows over every key
    (:func:`~probe.stats.paths.centred.centred_rows`) and blocks of keys
    (:func:`~probe.stats.paths.key_blocks.blocked_rows`, 16 keys and 16 rows per block here, so
    that these small calls span several)."""
    blocked = request.param == "key blocks"
    monkeypatch.setattr(plan, "blocked_keys", lambda *args: blocked)
    if blocked:
        monkeypatch.setattr(key_blocks, "_BLOCK_BYTES", 1)
    return request.param


def _spy(monkeypatch):
    seen = []
    for module in (centred, key_blocks):
        real = module.forward_rows

        def spy(*args, _real=real, **kwargs):
            seen.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "forward_rows", spy)
    return seen


def _check(call, key_mask, scale=0.25, rtol=1e-5, rows=None):
    got = forward_stats(call, {"actual": scale}, budget_bytes=2**14, rows=rows)  # several chunks
    ref = _reference(call, key_mask, scale)
    n, mean, m2 = got["logit@actual"].double()
    torch.testing.assert_close(n, ref["count"], rtol=0, atol=0)
    seen = ref["count"] > 0
    spread = ref["var"][seen].sqrt().max().item()  # a mean near 0 is exact to the logits' spread
    torch.testing.assert_close(mean, ref["mean"], rtol=rtol, atol=1e-6 * spread)
    torch.testing.assert_close((m2 / n.clamp(min=1))[seen], ref["var"][seen], rtol=rtol, atol=1e-12)
    torch.testing.assert_close(got["logit_max@actual"].double(), ref["max"], rtol=1e-6, atol=1e-6)
    if rows is None:
        torch.testing.assert_close(got["entropy@actual"].double(), ref["entropy"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got["max_prob@actual"].double(), ref["max_prob"], rtol=1e-4, atol=1e-4)
    assert float(got["nonfinite"].sum()) == 0
    return got


@pytest.mark.parametrize("hk", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["none", "row", "full"])
def test_centred_moments_match_float64(monkeypatch, path, kind, causal, hk):
    seen = _spy(monkeypatch)
    q, k = _inputs(hk=hk)
    mask, key_mask = _mask(kind, 2, 40, 40)
    if kind == "full" and causal:  # Hugging Face's causal and padding mask, with is_causal
        mask = mask & torch.ones(40, 40, dtype=torch.bool).tril()
    call = AttentionCall(q=q, k=k, v=None, scale=0.25, mask=mask, causal=causal)
    _check(call, key_mask)
    assert seen  # the centred path ran


@pytest.mark.parametrize("hk", [4, 2])
def test_hugging_faces_causal_padding_mask_without_is_causal(monkeypatch, path, hk):
    # transformers passes causality and padding as one (B, 1, L, S) bool mask, is_causal=False
    seen = _spy(monkeypatch)
    q, k = _inputs(hk=hk)
    mask, key_mask = _mask("full", 2, 40, 40)
    mask = mask & torch.ones(40, 40, dtype=torch.bool).tril()
    call = AttentionCall(q=q, k=k, v=None, scale=0.25, mask=mask, causal=False)
    assert masks.key_validity(call)[2] is True
    got = forward_stats(call, {"actual": 0.25}, budget_bytes=2**14)
    ref = _check(AttentionCall(q=q, k=k, v=None, scale=0.25, mask=key_mask, causal=True), key_mask)
    for key in got:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-6, atol=1e-6, msg=key)
    assert seen


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(40, 17), (17, 40), (1, 1), (1, 5), (5, 1)])
def test_lengths_and_tiny_shapes(monkeypatch, path, shape, causal):
    seen = _spy(monkeypatch)
    l, s = shape
    q, k = _inputs(l=l, s=s)
    mask, key_mask = _mask("row", 2, l, s) if s > 2 else (None, None)
    _check(AttentionCall(q=q, k=k, v=None, scale=0.25, mask=mask, causal=causal), key_mask)
    assert seen


def test_a_fully_padded_batch_row_counts_nothing(monkeypatch, path):
    seen = _spy(monkeypatch)
    q, k = _inputs()
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[1] = False
    got = _check(AttentionCall(q=q, k=k, v=None, scale=0.25, mask=mask), mask)
    assert seen and torch.equal(got["rows"], torch.full((4,), 40.0, dtype=got["rows"].dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mean,noise", [(10.0, 1e-2), (100.0, 1e-3), (30.0, 1e-4)])
def test_mean_dominated_logits_keep_their_variance(monkeypatch, path, mean, noise, causal):
    # logits ~ d·mean² with a spread ~1e-3 .. 1e-6 of it: float32 logits keep ~1e-3 of the
    # variance at the worst case here (the path before this one); the centred path's float64 row
    # shift keeps 1e-6 (measured ~1e-8)
    seen = _spy(monkeypatch)
    q, k = _inputs(l=300, s=300, d=16, mean=mean, noise=noise)
    call = AttentionCall(q=q, k=k, v=None, scale=1.0, causal=causal)
    got = forward_stats(call, {"actual": 1.0})
    ref = _reference(call, None, 1.0)
    n, mu, m2 = got["logit@actual"].double()
    torch.testing.assert_close(m2 / n, ref["var"], rtol=1e-6, atol=0)
    torch.testing.assert_close(mu, ref["mean"], rtol=1e-9, atol=0)
    assert seen


def test_sampled_rows_take_the_centred_path_too(monkeypatch, path):
    seen = _spy(monkeypatch)
    q, k = _inputs(l=64, s=64)
    call = AttentionCall(q=q, k=k, v=None, scale=0.25, causal=True)
    got = _check(call, None, rows=torch.tensor([0, 5, 17, 40, 63]))
    assert seen and "entropy_var@actual" in got


@pytest.mark.parametrize("poison", ["nan", "inf", "huge"])
def test_inputs_not_proven_finite_take_the_exact_path(monkeypatch, poison):
    seen = _spy(monkeypatch)
    q, k = _inputs()
    q[0, 1, 3, 2] = {"nan": math.nan, "inf": math.inf, "huge": 1e30}[poison]
    call = AttentionCall(q=q, k=k, v=None, scale=0.25, causal=True)
    assert not plan.inputs_finite(call)
    got = forward_stats(call, {"actual": 0.25})
    assert not seen
    if poison != "huge":
        assert float(got["nonfinite"].sum()) > 0


def test_a_mask_that_depends_on_the_row_takes_the_exact_path(monkeypatch):
    seen = _spy(monkeypatch)
    q, k = _inputs()
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool)
    mask[0, 0, 3, :10] = False
    call = AttentionCall(q=q, k=k, v=None, scale=0.25, mask=mask)
    assert masks.key_validity(call)[0] is False
    forward_stats(call, {"actual": 0.25})
    assert not seen


def test_the_row_independence_verdict_follows_in_place_changes():
    q, k = _inputs()
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool)
    call = AttentionCall(q=q, k=k, v=None, scale=0.25, mask=mask)
    assert masks.key_validity(call)[0]
    mask[0, 0, 3, 1] = False  # the same tensor, changed: checked again
    assert not masks.key_validity(call)[0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cap_bytes", [1, 3 * 2 * 2 * 40 * 4])
def test_sampled_rows_in_small_batches_give_the_same_sums(monkeypatch, causal, cap_bytes):
    """The gathered sampled rows run in batches of a bounded buffer (one row, three rows here):
    the same per-row sums as all at once (the chunked variant: the blocked one has no such buffer)."""
    monkeypatch.setattr(plan, "blocked_keys", lambda *args: False)
    from probe.stats.forward import forward_stats
    from probe.stats.sampling import sample_rows

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 40, 8, generator=gen) * 2
    k = torch.randn(2, 2, 40, 8, generator=gen)
    pad = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    pad[1, ..., 30:] = False
    call = AttentionCall(q=q, k=k, v=None, scale=0.5, causal=causal, mask=pad)
    rows = sample_rows(40, 16, torch.Generator().manual_seed(1))
    scales = {"actual": 0.5, "unscaled": 1.0}
    whole = forward_stats(call, scales, budget_bytes=2**12, rows=rows)  # small chunks: several
    monkeypatch.setattr(centred, "SAMPLED_BYTES", cap_bytes)
    batched = forward_stats(call, scales, budget_bytes=2**12, rows=rows)
    assert whole.keys() == batched.keys()
    for name in whole:
        torch.testing.assert_close(batched[name], whole[name], rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_a_per_head_key_mask_with_grouped_query_attention(monkeypatch, path, causal):
    # a (B, H, 1, S) mask: each query head its own valid keys, two query heads per kv head
    seen = _spy(monkeypatch)
    q, k = _inputs(hk=2, l=40, s=40)
    mask = torch.rand(2, 4, 1, 40, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True  # every causal row has a key
    _check(AttentionCall(q=q, k=k, v=None, scale=0.25, mask=mask, causal=causal), mask)
    assert seen


def test_key_blocks_take_long_calls_and_leave_short_ones():
    def call(b, h, hk, length, transposed=False):
        q, k = torch.empty(b, h, length, 64, device="meta"), torch.empty(b, hk, length, 64, device="meta")
        return AttentionCall(q=q, k=k, v=None, scale=0.125, causal=True)

    budget = 64 * 2**20
    step = lambda c: chunks.cache_chunk_rows(c.q.shape[0], c.q.shape[1], c.k.shape[2])  # noqa: E731
    for c, picks in [(call(2, 4, 4, 512), 128), (call(1, 8, 2, 1024), 128), (call(1, 8, 8, 1024), None)]:
        assert not plan.blocked_keys(c, None, min(step(c), c.q.shape[2]), picks, budget)  # the benchmarks' steps
    for length in (8192, 16384, 2**20):
        c = call(1, 8, 8, length)
        assert plan.blocked_keys(c, None, step(c), 128, budget)
        assert plan.blocked_keys(c, None, step(c), None, budget)


@pytest.mark.parametrize("length", [1024, 4096])
def test_key_blocks_keep_long_calls_within_the_budget(monkeypatch, length):
    """The chunked variant's centred copy of k and buffers over every key grow with S (at the
    default budget: 70 MiB of them at (1, 8, 16384, 64)); blocks of keys do not. Here a 4 MiB
    budget, which a centred copy of k alone exceeds at S = 2048: the probe's own tensors
    (the meter counts every storage created inside) stay within it, and a longer call takes
    no more memory than four times its per-row sums (``O(B·H·L)``, 60 bytes per row)."""
    from tests.faults.memory import PeakMemory

    budget = 4 * 2**20
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 8, length, 64, generator=g), torch.randn(1, 8, length, 64, generator=g)
    call = AttentionCall(q=q, k=k, v=None, scale=0.125, causal=True)
    buffers.forget()  # an earlier call's kept buffers (probe.stats.buffers) are not this call's
    with PeakMemory(cap=budget, exclude=(q, k)) as mem:
        got = forward_stats(call, {"actual": 0.125, "unscaled": 1.0}, budget_bytes=budget, rows=128,
                            generator=torch.Generator().manual_seed(1))
    assert not mem.refused
    per_row = 8 * length * 60
    assert mem.peak <= budget // 2 + per_row, (mem.peak, budget)
    assert torch.isfinite(got["entropy@actual"]).all()
    if length == 4096:  # the chunked variant asks for more than the whole budget at once (a 8 MiB k copy)
        monkeypatch.setattr(plan, "blocked_keys", lambda *args: False)
        with pytest.raises(MemoryError), PeakMemory(cap=budget, exclude=(q, k)):
            forward_stats(call, {"actual": 0.125, "unscaled": 1.0}, budget_bytes=budget, rows=128)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_sampled_rows_mask_padded_keys_as_every_row_does(monkeypatch, path, causal, side):
    """Padded keys are 0 in the centred product; the sampled rows' exponentials must still
    leave them out, and each row's max must be over its valid keys only: under causal masking a
    row sees a prefix of the keys, whose centred logits may all lie below 0 (checked), so a
    padded key's 0 would be taken for its max. The sampled rows' per-row entropy and max
    probability are those of the same rows when every row is computed."""
    from probe.stats.buffers import Scratch
    from probe.stats.forward import PATH_MODULES

    q, k = _inputs(b=2, hk=2, l=40, s=40, seed=4)
    pad = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    pad[1, ..., :12] = False if side == "left" else True
    pad[1, ..., 28:] = True if side == "left" else False
    call = AttentionCall(q=q, k=k, v=None, scale=0.25, causal=causal, mask=pad)
    if causal:  # the centred logits q_i·(k_j − k̄), k̄ the mean of the valid keys
        z, valid = masked_logits64(q, k, 0.25, causal, pad)
        w = pad[:, 0, 0].double()[:, None, :, None]  # (B, 1, S, 1)
        kbar = (k.double() * w).sum(2) / w.sum(2)  # (B, Hk, d)
        centre = 0.25 * (q.double() * kbar.repeat_interleave(2, 1)[:, :, None]).sum(-1)
        row_max = (z - centre[..., None]).masked_fill(~valid, -math.inf).amax(-1)
        assert (row_max[valid.any(-1)] < 0).sum() >= 3  # rows whose valid ones are all below 0
    scales = {"actual": 0.25, "unscaled": 1.0}
    picked = torch.tensor([1, 2, 3, 5, 8, 12, 13, 14, 15, 20, 27, 28, 29, 33, 39])

    def rows(positions):
        planned, p = plan.plan_call(call, scales, 2**12, positions)
        assert p.path in ("centred", "key_blocks")
        return PATH_MODULES[p.path].forward_rows(planned, p, Scratch(0, q.device))

    every, sampled = rows(None), rows(picked)
    for name in ("soft_n", "entropy", "max_prob"):
        torch.testing.assert_close(getattr(sampled, name), getattr(every, name)[..., picked], rtol=1e-5,
                                   atol=1e-6, msg=name)
    _check(call, pad)


@pytest.mark.parametrize("valid_kind", ["none", "row"])
@pytest.mark.parametrize("hk", [4, 2])
def test_prep_row_sums_are_those_of_its_centred_keys(valid_kind, hk):
    """Without causal masking the prep's one product per block gives each row's ``Σ_j C_ij``
    (``q_i·Σk̃`` over the valid keys, the rounded centred keys it multiplies) and its shift
    ``q_i·k̄``, both against float64 references, also for mean-dominated q (the shift's large part
    is float64) and grouped-query attention."""
    q, k = _inputs(hk=hk, l=37, s=45, d=16, mean=300.0, noise=0.5, seed=3)
    _, key_mask = _mask(valid_kind, 2, 37, 45)
    valid = None if key_mask is None else key_mask[:, :, 0].expand(2, 1, 45)
    call = AttentionCall(q=q, k=k, v=None, scale=None)
    prep = centred.CentredPrep(call, valid)
    assert prep.csum is not None and prep.csum.dtype == torch.float64
    g = 4 // hk
    kt = prep.kt.double().repeat_interleave(g, 1)  # (B, H, d, S): masked keys are zero there
    want = (q.double() @ kt).sum(-1)
    scale = q.double().norm(dim=-1) * kt.sum(-1).norm(dim=-1).unsqueeze(-1)
    assert torch.all((prep.csum - want).abs() <= 1e-5 * scale + 1e-12)
    kbar = prep.kbar.double().repeat_interleave(g, 1)  # (B, H, d, 1)
    shift = (q.double() @ kbar).squeeze(-1)
    assert torch.allclose(prep.shift, shift, rtol=1e-9, atol=1e-6)
    assert torch.equal(centred.row_sums(prep, q, buffers.Scratch(0, q.device)), prep.csum)
    causal = centred.CentredPrep(AttentionCall(q=q, k=k, v=None, scale=None, causal=True), valid)
    assert causal.csum is None  # causal rows sum prefixes of the keys (row_sums)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["none", "row"])
def test_logits_whose_squares_overflow_float32_are_measured_again_rescaled(monkeypatch, path, kind, causal):
    """Logits near 1e20 (proven finite: the centred paths) with a scale of 1e-20, so that the
    softmax is an ordinary one: each row's float32 sum of squares overflows, and the call is
    measured again on q, k scaled by 2^-32 at scales 2^64 times larger. Every statistic matches
    float64, the backward's too; with logits 2^32 times smaller the first measurement stands."""
    import probe.stats.forward as forward
    from probe.stats.backward import grad_logits_stats

    seen = _spy(monkeypatch)
    again = []
    real = forward._rescaled_rows
    monkeypatch.setattr(forward, "_rescaled_rows", lambda *a: again.append(1) or real(*a))
    q, k = _inputs(hk=2)
    q, k = q * 1e10, k * 1e10
    mask, key_mask = _mask(kind, 2, 40, 40)
    call = AttentionCall(q=q, k=k, v=None, scale=1e-20, mask=mask, causal=causal)
    got = _check(call, key_mask, scale=1e-20, rtol=1e-5)
    assert seen and again and torch.isfinite(got["logit@actual"]).all()
    # the backward (the sampled rows' kept exponentials included) against float64
    v = torch.randn(2, 2, 40, 8, generator=torch.Generator().manual_seed(3))
    dout = torch.randn(2, 4, 40, 8, generator=torch.Generator().manual_seed(4))
    call = AttentionCall(q=q, k=k, v=v, scale=1e-20, mask=mask, causal=causal)
    z, valid = masked_logits64(q, k, 1e-20, causal, key_mask)
    p = torch.softmax(z.masked_fill(~valid, -math.inf), -1).nan_to_num(0.0)
    dP = dout.double() @ v.double().repeat_interleave(2, 1).transpose(-1, -2)
    want = (p * (dP - (p * dP).sum(-1, keepdim=True))).square().sum((0, 2, 3))
    grads = grad_logits_stats(call, dout, {"actual": 1e-20}, 2**14)
    torch.testing.assert_close(grads["grad_logits_sq@actual"], want, rtol=1e-4, atol=0)
    again.clear()
    _check(AttentionCall(q=q * 2.0**-32, k=k * 2.0**-32, v=None, scale=1e-20 * 2.0**64, mask=mask, causal=causal),
           key_mask, scale=1e-20 * 2.0**64, rtol=1e-5)
    assert not again


@pytest.mark.parametrize("causal", [False, True])
def test_the_rescaled_measurement_hands_its_kept_exponentials_to_the_backward(monkeypatch, causal):
    """With sampled rows the forward keeps their exponentials for the backward (``plan.carry``);
    measured again rescaled, the kept ones are the second measurement's (of the same ``σR``), and
    the backward from them equals the backward that recomputes."""
    import probe.stats.forward as forward
    from probe.stats.backward import grad_logits_stats

    again = []
    real = forward._rescaled_rows
    monkeypatch.setattr(forward, "_rescaled_rows", lambda *a: again.append(1) or real(*a))
    q, k = _inputs(hk=2, l=64, s=64)
    q, k = q * 1e10, k * 1e10
    v = torch.randn(2, 2, 64, 8, generator=torch.Generator().manual_seed(3))
    dout = torch.randn(2, 4, 64, 8, generator=torch.Generator().manual_seed(4))
    call = AttentionCall(q=q, k=k, v=v, scale=1e-20, causal=causal)
    scales = {"actual": 1e-20, "unscaled": 1.0}
    call, kept_plan = plan.plan_call(call, scales, rows=16, generator=torch.Generator().manual_seed(0),
                                     keep_bytes=2**24)
    assert kept_plan.keep and kept_plan.path == "centred"
    forward.forward_rows(call, kept_plan)
    assert again and "exps" in kept_plan.carry
    kept = grad_logits_stats(call, dout, scales, plan=kept_plan)
    _, fresh_plan = plan.plan_call(call, scales, rows=kept_plan.positions)
    fresh = grad_logits_stats(call, dout, scales, plan=fresh_plan)
    for key in fresh:
        torch.testing.assert_close(kept[key], fresh[key], rtol=1e-4, atol=0, msg=key)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_causal_row_of_one_key_has_no_spread(monkeypatch, path, batch):
    # a causal call's first row sees one key, whose centred value C = q·(k₀ − k̄) is of the logits'
    # size: ΣC² − (ΣC)²/1 rounded to ~2⁻²⁴·C² (0.07 here) where the variance of one logit is 0
    seen = _spy(monkeypatch)
    q, k = _inputs(b=batch, h=2, hk=2, l=1, s=5, d=32, noise=10.0, seed=3)
    call = AttentionCall(q=q, k=k, v=None, scale=1.0, causal=True)
    got = _check(call, None, scale=1.0, rtol=1e-6)
    m2 = got["logit@actual"][2]
    if batch == 1:  # one logit per head
        assert torch.equal(m2, torch.zeros_like(m2))
    assert seen
