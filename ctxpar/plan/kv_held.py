"""What Gemma 4's attention layers keep on their modules, outside autograd, from one forward
to the next (models/attention.py): the planner charges it in every phase of the step.

- shared K/V (model.num_kv_shared_layers): a producer layer keeps its K/V for the layers
  attending with it (``shared_kv``: its local K,V, or k_proj x alone where that is on the
  wire) and, exchanged once for them all (``held_kv``, ContextParallel.held_kv /
  held_latent), under 'allgather' every rank's slots (P x the local tensors: GatherSlots;
  not where a short window's halo is the exchange, k_proj x on the wire excepted) and
  under 'ulysses' the K,V regrouped by heads (the local bytes at Ulysses' kv heads). The
  module's references keep both until the producer's next forward replaces them: through
  the backward, the gradients' reduction, the optimizer step and an evaluation.
- the whole sequence's (cos, sin) of keys equal to values on the wire (model.
  attention_k_eq_v under CP: set_sequence_rotary): T x a layer's rotary channels, fp32,
  one pair per distinct RoPE of those layers, held until the next forward.

What autograd saves meanwhile is counts.py's: in modes 'none' and 'selective' the producer's
core saves the slots' views in place of its local K,V, which counts.attention_saved charges
and shared_kv keeps alive; so during the step the slots come on top, and under 'full' (the
core saves nothing) the local K,V too. A pipeline's stages carry K and V instead
(kv_layers.carried_bytes: nothing is held across the step there).
"""
from __future__ import annotations

from typing import Dict

from ..config import ModelConfig, rotary_dim
from ..config.layers import kv_sources, layer_attention
from ..config.parameters import kv_heads_per_rank, layer_head_dim, layer_kv_heads, layer_v_head_dim
from ..context_parallel.ulysses import ulysses_kv_heads
from .candidate import Candidate
from .counts import layer_modes
from .comm_bytes import halo_received
from .kv_layers import exchange_held, wire_tensors


def _producer_bytes(m: ModelConfig, cand: Candidate, j: int, tokens: int, e: int):
    """(local, exchanged) bytes producer layer j keeps for its consumers: its shared_kv
    (K,V or k_proj x) and its held_kv (the all-gather's slots, Ulysses' regrouping, or 0)."""
    a = layer_attention(m)[j]
    hk = kv_heads_per_rank(m, cand.tp, layer_kv_heads(m, a))
    hd, vd = layer_head_dim(m, a), layer_v_head_dim(m, a)
    wire = wire_tensors(m, a, cand) == 1  # k_proj x alone (held_latent: no halo rule)
    width = hd if wire else hd + vd
    local = tokens * hk * width * e
    exchanged = 0
    if exchange_held(m, a, cand, halo_received(m, cand, a) >= 0):
        exchanged = cand.cp * local if cand.cp_comm == "allgather" else \
            tokens * ulysses_kv_heads(hk, cand.ulysses) * width * e  # Ulysses' regrouping
    return local, exchanged


def shared_kv_held(m: ModelConfig, cand: Candidate, tokens: int, e: int, start: int,
                   blocks: int) -> Dict[str, float]:
    """{'during': bytes beyond counts.py's saved activations while the step's forward and
    backward run, 'after': bytes after its backward (reduction, step, evaluation)} the
    producers among blocks start .. start + blocks - 1 keep (tokens: N on the rank)."""
    if not m.num_kv_shared_layers or cand.pp > 1:
        return {"during": 0.0, "after": 0.0}
    modes = layer_modes(cand, start + blocks)
    during = after = 0.0
    for j in sorted(set(kv_sources(m).values())):
        if not start <= j < start + blocks:
            continue
        local, exchanged = _producer_bytes(m, cand, j, tokens, e)
        during += exchanged + (local if modes[j] == "full" else 0)
        after += exchanged + local
    return {"during": during, "after": after}


def sequence_rotary_held(m: ModelConfig, cand: Candidate, batch: int,
                         reset_positions: bool) -> int:
    """Bytes of the whole sequence's (cos, sin) the k_eq_v layers' expansions read: T x
    the rotary channels x 4 per distinct RoPE (rope_theta, rope_scaling, channels) of the
    layers whose k_proj x travels alone and makes its own K/V (per sample with
    reset_positions: the positions are (B, T))."""
    ropes = {(a.rope_theta, repr(a.rope_scaling), a.head_dim or rotary_dim(m))
             for a in layer_attention(m)
             if a.rope and a.kv_source is None and wire_tensors(m, a, cand) == 1}
    rows = batch if reset_positions else 1
    return sum(rows * m.seq_len * dim * 4 for _, _, dim in ropes)
