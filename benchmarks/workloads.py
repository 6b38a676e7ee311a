"""Training steps the benchmarks time: Hugging Face models built from configs (random weights).

- ``bert``: BERT encoder, SDPA, 4 layers, hidden 256, 4 heads (d_k 64), no attention mask (the
  friendliest case; the earlier tables in docs/performance.md).
- ``bert-padded``: the same encoder, batch 2, sequence 512, an attention mask whose second row
  is 25 % padding (Hugging Face turns it into a float SDPA mask).
- ``llama-gqa``: Llama decoder, SDPA, 4 layers, hidden 256, 8 query heads / 2 kv heads (d_k 32),
  batch 1, sequence 1024, causal.
- ``bert-padded-eager``, ``llama-gqa-eager``: the same models with ``attn_implementation="eager"``:
  an explicit softmax over ``q·kᵀ·s + mask``, the mask a float tensor (0 / ``finfo.min``).
- ``t5``: T5 encoder-decoder, ``attn_implementation="sdpa"`` (T5 computes its attention itself:
  ``q·kᵀ + position_bias``, a genuine additive float bias, the general path), 4 + 4 layers,
  d_model 256, 4 heads (d_kv 64), batch 1, sequence 512 (encoder and decoder).
- ``gemma2-eager``: Gemma 2 decoder, eager (logits soft-capped at 50, the general path), 4 layers,
  hidden 256, 8 heads / 2 kv heads (head_dim 32), sliding window off, batch 1, sequence 1024, causal.

Each step is forward + backward of a scalar loss (the mean square of the last hidden state).
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple

import torch

__all__ = ["WORKLOADS", "Workload", "build"]


class Workload(NamedTuple):
    name: str
    description: str
    model: torch.nn.Module
    step: Callable[[torch.nn.Module], None]


def _bert(seq: int, batch: int, padded: bool, attn: str = "sdpa") -> Workload:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=max(512, seq), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation=attn,
    )
    model = BertModel(config).train()
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded and batch > 1:
        mask[1, seq - seq // 4:] = 0  # the second row: its last quarter is padding

    def step(m: torch.nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, attention_mask=mask if padded else None).last_hidden_state
        out.float().square().mean().backward()

    what = "padding mask (2nd row 25 % padding)" if padded else "no mask"
    desc = f"HF BERT, {_ATTN[attn]}, 4 layers, hidden 256, 4 heads, batch {batch}, seq {seq}, {what}"
    name = ("bert-padded" if padded else "bert") + ("" if attn == "sdpa" else f"-{attn}")
    return Workload(name, desc, model, step)


def _llama(seq: int, batch: int, attn: str = "sdpa") -> Workload:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max(1024, seq),
        attn_implementation=attn,
    )
    model = LlamaModel(config).train()
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (batch, seq))

    def step(m: torch.nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids).last_hidden_state
        out.float().square().mean().backward()

    desc = f"HF Llama, {_ATTN[attn]}, 4 layers, hidden 256, 8 heads / 2 kv heads, batch {batch}, seq {seq}, causal"
    return Workload("llama-gqa" + ("" if attn == "sdpa" else f"-{attn}"), desc, model, step)


def _t5(seq: int, batch: int) -> Workload:
    from transformers import T5Config, T5Model

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=1000, d_model=256, d_kv=64, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=4,
        dropout_rate=0.0, attn_implementation="sdpa",
    )
    model = T5Model(config).train()
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (batch, seq))
    dec = torch.randint(0, 1000, (batch, seq))

    def step(m: torch.nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, decoder_input_ids=dec).last_hidden_state
        out.float().square().mean().backward()

    desc = f"HF T5, SDPA (own attention, relative position bias), 4+4 layers, d_model 256, 4 heads, batch {batch}, seq {seq}"
    return Workload("t5", desc, model, step)


def _gemma2(seq: int, batch: int) -> Workload:
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=max(1024, seq), sliding_window=max(1024, seq),
        attn_logit_softcapping=50.0, final_logit_softcapping=None, attn_implementation="eager",
    )
    model = Gemma2Model(config).train()
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (batch, seq))

    def step(m: torch.nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids).last_hidden_state
        out.float().square().mean().backward()

    desc = f"HF Gemma 2, eager, softcap 50, 4 layers, hidden 256, 8 heads / 2 kv heads, batch {batch}, seq {seq}, causal"
    return Workload("gemma2-eager", desc, model, step)


_ATTN = {"sdpa": "SDPA", "eager": "eager (float mask, explicit softmax)"}


#: name -> (default seq, default batch, builder(seq, batch))
WORKLOADS: Dict[str, tuple] = {
    "bert-padded": (512, 2, lambda seq, batch: _bert(seq, batch, padded=True)),
    "llama-gqa": (1024, 1, _llama),
    "bert": (512, 2, lambda seq, batch: _bert(seq, batch, padded=False)),
    "bert-padded-eager": (512, 2, lambda seq, batch: _bert(seq, batch, padded=True, attn="eager")),
    "llama-gqa-eager": (1024, 1, lambda seq, batch: _llama(seq, batch, attn="eager")),
    "t5": (512, 1, _t5),
    "gemma2-eager": (1024, 1, _gemma2),
}


def build(name: str, seq: int = 0, batch: int = 0) -> Workload:
    """The workload ``name`` at ``seq`` / ``batch`` (0: its default)."""
    default_seq, default_batch, builder = WORKLOADS[name]
    return builder(seq or default_seq, batch or default_batch)
