"""What a layer holds for a moment and does not save: working buffers, recomputation, grads.

Per rank (counts.RankShapes): N tokens, d model width, f = ffn/tp, q = N h hd and
kv = N hk hd elements (h, hk the heads on this rank), e the activations' element size.
Read from the code that allocates them (ctxpar/context_parallel/*.py, models/gpt.py,
ctxpar/tensor_parallel/cross_entropy.py, ctxpar/memory/*.py) and held to the allocator's
live bytes on CPU (tools/benchmarks/bench_plan_memory.py, docs/planner.md):

- a halo exchange (a short window or chunks: halo.py) instead of the ring's or
  all-gather's: the tails sent, received and concatenated, (k, v) of `halo` tokens each,
  beside the same accumulators; backward also their fp32 dK,dV and those sent and
  received in ring_grad_dtype (all-gather: fp32).
- attention, forward: the ring's receive buffers (two K,V pairs, one for a single hop) and
  a block's output; all-gather's stacked and gathered K,V; Ulysses' all-to-all send and
  receive buffers of q, k, v; with 16-bit inputs the fp32 (out, lse) accumulators.
- attention, backward: fp32 dq and dK,dV accumulators (all-gather: one per rank's slot,
  then reduce-scattered), the travelling dK,dV (ring_grad_dtype), receive buffers, a
  block's dq, dk, dv; Ulysses' all-to-alls of dout and of dq, dk, dv.
- MLP: in a replayed (checkpointed) block's forward its (N, f) intermediates at once
  (mlp_widths.py, by model.mlp: a gated one's gate, up, the activation and the product,
  model.swiglu_limit's clamped copies replacing gate and up; GELU's up and gelu(up);
  squared ReLU's up, relu(up) and its square); in backward the (N, f) gradients beyond
  the saved ones (gated: the product's two inputs'; the clamps' unclamped inputs are
  saved: counts.py); a tiled MLP's replayed tile saves its intermediates beside them;
  just after it, its dx beside the second norm's backward products (N, d).
- the loss: the (N, V/tp) logits next to the fp32 softmax the loss saves (forward); the
  backward writes the gradient into that softmax (no copy in fp32).
- a checkpointed block's backward first replays its forward: its 'none' activations (or,
  under 'selective', the MLP piece's) exist again on top of what is saved.
"""
from __future__ import annotations

from ..context_parallel.ulysses import ulysses_kv_heads
from .candidate import Candidate
from . import dsa_layers, mla_layers
from .counts import RankShapes, attention_saved, ring_grad_bytes
from .mlp_widths import mlp_widths


def _ring_fwd(q: float, kv: float, hops: int, e: int) -> float:
    pairs = min(hops, 2)                        # KVRing's alternating receive buffers
    acc = 8 * q if e != 4 else 0.0              # fp32 out accumulator + a block's fp32 copy
    return pairs * 2 * kv * e + q * e + acc     # + one block's kernel output


def _ring_bwd(q: float, kv: float, hops: int, e: int, g: int) -> float:
    pairs = min(hops, 2)
    acc = 4 * q + 2 * kv * 4                    # dq, dK,dV accumulators (fp32)
    travel = 2 * kv * g * (1 if g == 4 else 2)  # the received dK,dV (+ a send copy in bf16)
    copies = (q + 2 * kv) * e if e != 4 else 0.0  # the final .to(dtype) of dq, dk, dv
    return acc + travel + pairs * 2 * kv * e + (q + 2 * kv) * e + copies


def attention_forward(s: RankShapes, cand: Candidate, e: int, halo: int = -1,
                      m=None, replayed: bool = False) -> float:
    """Bytes the CP attention holds in its forward beyond what it saves (one layer);
    halo >= 0: the layer's halo exchange, `halo` K,V tokens received by the busiest rank
    (comm_bytes.halo_received); m with model.mla: the latent attention's (mla_layers), in a
    block that saves nothing (replayed: checkpointed or evaluated) beside q and the latent."""
    if m is not None and m.mla is not None:  # a replayed block holds q and the latent too
        return mla_layers.attention_forward(s, cand, e, m) \
            + (mla_layers.core_inputs(s, e, m) if replayed else 0) \
            + (dsa_layers.working_set(s, m) if m.dsa is not None else 0)
    q, kv = s.N * s.h * s.hd, s.N * s.hk * s.hd
    if cand.cp == 1:
        return 0.0
    if halo >= 0 and cand.cp_comm in ("ring", "allgather"):
        return 3 * 2 * s.B * halo * s.hk * s.hd * e + q * e + (8 * q if e != 4 else 0.0)
    if cand.cp_comm == "ring":
        return _ring_fwd(q, kv, cand.cp - 1, e)
    if cand.cp_comm == "allgather":
        return (1 + cand.cp) * 2 * kv * e + q * e + (8 * q if e != 4 else 0.0)
    kvu = s.N * ulysses_kv_heads(s.hk, cand.ulysses) * s.hd
    a2a = 2 * (q + 2 * kvu) * e                 # send + receive of q, k, v
    if cand.cp_comm == "hybrid":
        return a2a + _ring_fwd(q, kvu, cand.ring - 1 if halo < 0 else 0, e)
    return a2a


def attention_backward(s: RankShapes, cand: Candidate, e: int, halo: int = -1,
                       m=None) -> float:
    """Bytes the CP attention holds in its backward beyond its saved tensors and dout
    (halo, m: as attention_forward's)."""
    if m is not None and m.mla is not None:
        return mla_layers.attention_backward(s, cand, e, m)
    q, kv = s.N * s.h * s.hd, s.N * s.hk * s.hd
    g = ring_grad_bytes(cand.ring_grad_dtype)
    if cand.cp == 1:
        return (q + 2 * kv) * e                 # the kernel's dq, dk, dv
    if halo >= 0 and cand.cp_comm in ("ring", "allgather"):
        hkv = 2 * s.B * halo * s.hk * s.hd      # (k, v) elements of the tails
        g = 4 if cand.cp_comm == "allgather" else g
        copies = (q + 2 * kv) * e if e != 4 else 0.0
        return 4 * q + 2 * kv * 4 + (q + 2 * kv) * e + copies \
            + 3 * hkv * e + hkv * 4 + 2 * hkv * g
    if cand.cp_comm == "ring":
        return _ring_bwd(q, kv, cand.cp - 1, e, g)
    if cand.cp_comm == "allgather":
        gathered = (1 + cand.cp) * 2 * kv * e    # stacked + gathered K,V
        return gathered + 4 * q + cand.cp * 2 * kv * 4 + 2 * kv * 4 + (q + 2 * kv) * e
    kvu = s.N * ulysses_kv_heads(s.hk, cand.ulysses) * s.hd
    a2a = 3 * (q + 2 * kvu) * e                 # the kernel's grads, their send and receive
    if cand.cp_comm == "hybrid":
        return max(a2a, 2 * q * e + _ring_bwd(q, kvu, cand.ring - 1 if halo < 0 else 0, e, g))
    return a2a


def mlp_backward(s: RankShapes, kind: str, e: int, tile: int = 0,
                 mlp_params: int = 0, weight: int = 0, clamped: int = 0) -> float:
    """The MLP's backward (model.mlp `kind`): its (N, f) gradients beyond the saved
    tensors (mlp_widths: a SwiGLU's product's two inputs'); tiled
    (ctxpar/memory/tiled_mlp.py), its largest point over the tiles, beside the (N, d) dx
    buffer and the running sums of the weights' gradients (mlp_params, fp32): one tile's
    replayed intermediates (what the kind saves) and output, with either down's input
    gradient and its weight's tile gradient (`weight` elements: the Function adds each
    to its sum as soon as it is made) or, after, the activation's gradients; a single
    tile finds no sums yet, it makes them; or, 16-bit, the end, where the sums are cast to
    the weights' dtype beside themselves. The weights' gradients are the parameters' only
    once the Function returns: the caller charges none of the MLP's meanwhile. clamped:
    the (t, f) tensors more the replayed tile saves (moe_layers.clamp_saved: 2 under
    model.swiglu_limit, the clamps' inputs)."""
    w = mlp_widths(kind)
    if not tile:
        return w.backward * s.N * s.f * e
    t = min(tile, s.N)
    sums = mlp_params * 4
    # the replayed tile's saved intermediates and its output (t, d), through its backward
    kept = (w.saved + clamped) * t * s.f * e + t * s.d * e
    at_down = t * s.f * e + weight * e  # down's input gradient, its weight's tile gradient
    at_act = w.backward * t * s.f * e   # the activation's, that gradient added to its sum
    if t >= s.N:  # a single tile makes the sums: down's first (16-bit: its fp32 copy too)
        at_down, at_act = at_down + (weight * 4 if e != 4 else 0), at_act + weight * 4
    else:         # the last tile finds every sum made
        at_down, at_act = at_down + sums, at_act + sums
    tiles = kept + max(at_down, at_act)
    cast = sums + mlp_params * e if e != 4 else 0.0
    return s.N * s.d * e + max(tiles, cast)


def after_mlp_backward(s: RankShapes, e: int, norm: str, device: str,
                       mlp_grads: float) -> float:
    """Just after the MLP's backward, at the second norm's: the MLP's dx (N, d) and the
    norm's backward products (CPU's composite RMSNorm makes two (N, d) tensors; a fused
    kernel or LayerNorm its dx) beside the MLP's weight gradients (mlp_grads bytes, those
    the caller does not charge otherwise). A tiled MLP's own backward is fixed by its
    tiles while this grows with N: at long sequences it is the block's MLP-side peak."""
    k = 2 if norm == "rmsnorm" and device == "cpu" else 1
    return (1 + k) * s.N * s.d * e + mlp_grads


def mlp_forward(s: RankShapes, kind: str, e: int, tile: int = 0) -> float:
    """The MLP's forward working set beyond what it saves (model.mlp `kind`): tiled (no
    grad), one tile's intermediates at once (mlp_widths' forward: a SwiGLU's gate, up,
    silu(gate) and product) and the (N, d) output buffer; untiled, those of its
    intermediates it does not save (squared ReLU's up, beside relu(up) and its square)."""
    w = mlp_widths(kind)
    if not tile:
        return (w.forward - w.saved) * s.N * s.f * e
    return w.forward * min(tile, s.N) * s.f * e + s.N * s.d * e


def block_forward(s: RankShapes, cand: Candidate, mode: str, kind: str, e: int,
                  tile: int = 0, moe: float = None, m=None) -> float:
    """A checkpointed block's forward intermediates (nothing saved) at its MLP, the largest
    point: the MLP's (N, f) intermediates at once (mlp_widths' forward for model.mlp
    `kind`: a SwiGLU's gate, up, silu(gate) and product; with a tiled MLP one tile's; a
    mixture of experts' `moe` bytes, moe_layers.forward_working_set), the residual and the
    normed input (N, d); under 'full' also q, k, v and the attention's output, which
    Block.forward holds until it returns ('selective' saves them; MLA: q, the latent and
    the output, mla_layers.forward_held)."""
    if moe is not None:
        out = moe + 2 * s.N * s.d * e
    elif tile:
        out = mlp_forward(s, kind, e, tile) + 2 * s.N * s.d * e
    else:
        out = mlp_widths(kind).forward * s.N * s.f * e + 2 * s.N * s.d * e
    if mode == "full" and m is not None and m.mla is not None:
        out += mla_layers.forward_held(s, e, m)
    elif mode == "full":
        out += s.N * (2 * s.h + 2 * s.hk) * s.hd * e
    return out


def recompute(s: RankShapes, cand: Candidate, e: int, mode: str, mlp_saved: float,
              norm: float, m=None) -> float:
    """What a layer's backward replays on top of its saved tensors: 'full' its whole
    'none' activations but the input; 'selective' the MLP piece (norm + MLP);
    mlp_saved is what the MLP saves in 'none' mode (counts.channel_saved; tiled: nothing more),
    norm one norm's saved bytes (counts.norm_saved)."""
    if mode == "full":
        return 2 * norm + attention_saved(s, e, cand, m) + mlp_saved - s.N * s.d * e
    if mode == "selective":
        return norm + mlp_saved
    return 0.0


def loss_forward(s: RankShapes, e: int, tile: int = 0) -> float:
    """At the loss: the logits (N, V/tp) beside the fp32 softmax it saves; tiled
    (ctxpar/memory/tiled_loss.py, reduction 'sum'): one tile's scratch buffer (fp32: exp
    in place; 16-bit: the logits and their fp32 exp) and, 16-bit, each tile's dW product
    (V/tp, d) before it joins the fp32 sum. The dx (N, d) and fp32 dW (V/tp, d) it makes in
    forward are held to backward with the activations (counts.activations' head)."""
    if tile:
        return min(tile, s.N) * s.V * (4 if e == 4 else e + 4) + (s.V * s.d * e if e != 4 else 0)
    return s.N * s.V * e


def loss_backward(s: RankShapes, e: int, tile: int = 0) -> float:
    """The loss's backward: the gradient written into the saved fp32 softmax (16-bit: its
    cast copy). Tiled, nothing is computed: the held dx is scaled in place into the
    activation gradient and, fp32, the held dW into the head's gradient, both of which the
    phase charges already, so they come off the activations' count here (16-bit: dW's cast
    is the charged gradient, the fp32 sum stays until it is made)."""
    if tile:
        return -(s.N * s.d * e + (s.V * s.d * 4 if e == 4 else 0))
    return s.N * s.V * e if e != 4 else 0.0
