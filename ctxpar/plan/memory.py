"""Memory per GPU, phase by phase: what the program holds live at each phase's peak.

One rank (the most loaded pipeline stage), one step, in the order the program runs it:

    forward         model state + the micro-batches in flight + the activations saved so
                    far + the largest transient: the last block's working buffers (a
                    replayed block's intermediates, the CP attention's buffers), or the
                    loss's logits beside its saved softmax
    backward, loss  everything saved + the loss's gradient + the head's gradients
    backward, last  the saved activations of the blocks below + the first block the
    / first block   backward reaches (replayed when checkpointed) + its attention/MLP
                    backward buffers + the residual's gradient + the parameter gradients
                    produced so far (ZeRO's buckets as DeepSpeed holds them); and the same
                    at the last block it reaches, with nearly every gradient produced
    reduction       the end of the backward: every gradient and its reduction's copies
    optimizer step  DeepSpeed's fp32 gradient staging and torch Adam's temporaries
    evaluation      between steps, under no_grad (components/evaluation.py): model state +
                    the larger of a block's forward (nothing saved: a replayed block's
                    intermediates, or the CP attention's buffers) and, on the last stage,
                    the tiled evaluation head's (memory/tiled_eval.py: the hidden states,
                    one tile's logits and their fp32 softmax, the per-token results)

Activations are the counts of counts.py (exact against autograd's saved tensors), working
buffers transients.py's, model state zero_state.py's. Between the two blocks the backward
reaches first and last, saved activations fall and gradients rise, each linearly in the
blocks: the largest of the two ends is the backward's peak. The peak is the largest phase,
and the report names it. Held to train.py's measured peaks on CPU (docs/planner.md).

Memory options (config ``memory``, DeepSpeed's ``offload_optimizer``) change the terms:
tiled loss (no (N, V/tp) logits saved; one tile's at a time), tiled MLP (no (N, f)
intermediates saved; one tile's), activation offload (what checkpointing keeps per block
lives on the host but for two blocks' worth), optimizer offload (zero_state.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List

from ..config import Config, deepspeed_config
from ..config.layers import layer_attention
from ..config.layer_mixers import LAYER_MIXERS, LINEAR_MIXERS
from . import comm_bytes, counts, mla_layers, transients
from .kv_held import sequence_rotary_held, shared_kv_held
from .candidate import Candidate, apply_candidate
from .linear_layers import KINDS, linear_shapes, mixer_saved, mixer_working_set
from .linear_tiles import tiled_saved, tiled_working_set
from .moe_layers import (backward_working_set, block_model, clamp_saved, expert_tile,
                         forward_working_set, mixed_mlps)
from .mtp_layers import mtp_activations
from .zero_state import Shard, ZeroState, zero_config



@dataclass
class Phase:
    name: str
    terms: Dict[str, float]
    host: float = 0.0   # offloaded activations on the host meanwhile (bytes)

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass
class Memory:
    """Every phase of one rank's step; the peak is the largest. host: bytes per rank on
    the host (offloaded activations, optimizer state)."""
    phases: List[Phase]
    host: Dict[str, float] = field(default_factory=dict)
    host_step: float = 0.0   # torch AdamW's temporaries on the host during the step (CPU)

    @property
    def at_peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak(self) -> float:
        return self.at_peak.total

    @property
    def peak_phase(self) -> str:
        return self.at_peak.name

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    def same_ram(self) -> float:
        """Device and host in one memory (a CPU machine): the largest phase with the host's
        bytes, the step's host temporaries with the step."""
        fixed = self.host_total - self.host.get("activations (offloaded)", 0.0)
        return max(p.total + fixed + p.host + (self.host_step if p.name == "optimizer step"
                                               else 0.0) for p in self.phases)

    def as_dict(self) -> Dict[str, float]:
        """The peak phase's terms."""
        return dict(self.at_peak.terms)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


def tile_sizes(cfg: Config, s: counts.RankShapes, cand: Candidate):
    """(loss tile, MLP tile) in tokens, 0 when that option is off: the memory modules' own
    rule for 'auto' (ctxpar/memory/tiled_loss.py, tiled_mlp.py)."""
    mem = cfg.memory
    loss = mlp = 0
    if cand.tiled_loss:
        try:
            from ..memory.tiled_loss import loss_tile_tokens
        except ImportError:  # until the module lands: a given size, or one (N, d)'s worth
            def loss_tile_tokens(rows, vocab, d, setting):
                return setting if setting != "auto" else max(1, rows * d // vocab)
        loss = loss_tile_tokens(s.N, s.V, s.d, mem.loss_tile_tokens)
    if cand.tiled_mlp:
        try:
            from ..memory.tiled_mlp import mlp_tile_tokens
        except ImportError:
            def mlp_tile_tokens(tokens, d, ffn, setting):
                return setting if setting != "auto" else max(1, tokens * d // ffn)
        mlp = mlp_tile_tokens(s.N, s.d, s.f, mem.mlp_tile_tokens)
    return loss, mlp


def shard(m, tp: int, pp: int, stage: int, ep: int = 1) -> Shard:
    """What one rank of pipeline stage `stage` holds; a mixture of experts' experts are
    optimizer groups of their own at every layout but a pipeline at ep 1
    (models/training.py's param_groups), partitioned over their expert-data-parallel
    group."""
    psi = counts.stage_params(m, tp, pp, stage, ep)
    return Shard(psi=psi, psi0=psi - counts.stage_vector_params(m, tp, pp, stage),
                 largest=counts.largest_tensor(m, tp, ep), layer=counts.layer_params(m, tp, ep),
                 experts=counts.stage_experts(m, tp, pp, stage, ep)
                 if pp == 1 or ep > 1 else 0)


def ds_zero(cfg: Config, cand: Candidate) -> Dict:
    """zero_optimization as train.py hands it to DeepSpeed for this layout (the same
    ctxpar.config.deepspeed_config), with DeepSpeed's defaults for absent keys."""
    return zero_config(deepspeed_config(apply_candidate(cfg, cand), cand.dp))


@dataclass
class Stage:
    """What every phase of one pipeline stage's step reads: the rank's shapes, its saved
    activations, its ZeRO state and the terms each phase starts from."""
    cfg: Config
    cand: Candidate
    shapes: counts.RankShapes
    elem: int                  # bytes per activation element: 2 (bf16) or 4
    last: bool                 # the last stage: the final norm, the head and the loss
    device: str
    modes: List[str]           # each block's checkpointing mode
    act: counts.Activations    # one micro-batch's saved bytes
    saved: List[float]         # each block's saved bytes on the device (offload: two)
    zero_state: ZeroState
    shard: Shard
    resident: Dict[str, float]       # model state between steps
    base: Dict[str, float]           # resident + gathered parameters + other micro-batches
    accumulated: Dict[str, float]    # gradients kept between micro-batches (if any)
    accumulating: bool
    host: Dict[str, float]           # bytes on the host (optimizer offload, activations)
    host_step: float                 # torch AdamW's temporaries on the host (CPU)
    loss_tile: int
    mlp_tile: int
    # comm_bytes.halo_received of each kind of layer the stage holds; a phase charges the
    # largest attention buffers of them (a full layer's beside a windowed one's)
    halo: List[int] = field(default_factory=list)
    linear: int = 0  # the largest linear mixer's working set (linear_layers.mixer_saved)
    linear_kernel: int = 0  # its kernel's backward beyond it (mixer_working_set)
    types: List[str] = field(default_factory=list)  # each block's layer type (hybrids)
    # each block's MLP a mixture of experts (True) or dense (False) where model.moe.layers
    # leaves some dense (moe_layers.mixed_mlps); empty: every block's MLP alike
    moe_blocks: List[bool] = field(default_factory=list)
    # what Gemma 4's layers keep on their modules to the next forward (kv_held.py), after
    # the backward (the forward's and backward's share is in base)
    held_after: Dict[str, float] = field(default_factory=dict)

    def block_model(self, i: int):
        """The model block i's MLP counts read (the model without moe for a dense MLP
        beside MoE ones: moe_layers.block_model)."""
        m = self.cfg.model
        return block_model(m, self.moe_blocks[i]) if self.moe_blocks else m

    def grads(self, fraction: float) -> Dict[str, float]:
        """The gradient terms with `fraction` of this stage's produced (all of them while
        gradients accumulate over micro-batches)."""
        return self.zero_state.backward(1.0 if self.accumulating else fraction)

    @property
    def residual_grad(self) -> int:
        """The residual stream's gradient (N, d) the backward carries between blocks."""
        return self.shapes.N * self.shapes.d * self.elem


def stage(cfg: Config, cand: Candidate, bf16: bool, grad_accum: int, index: int, device: str,
          zero: Dict) -> Stage:
    """Stage `index`'s shapes, saved activations, model state and the micro-batches it
    holds at once (a pipeline's first stage holds pp - index of them)."""
    model, elem = cfg.model, 2 if bf16 else 4
    first, last = index == 0, index == cand.pp - 1
    blocks = counts.stage_layers(model, cand.pp, index)
    start = sum(counts.stage_layers(model, cand.pp, i) for i in range(index))
    # the phases' attention buffers: the stage's widest layer type's (layer_kv_heads)
    shapes = counts.rank_shapes(model, cand, counts.widest_kind(
        model, {a.kind for a in layer_attention(model)[start:start + blocks]}))
    loss_tile, mlp_tile = tile_sizes(cfg, shapes, cand)
    act = counts.activations(model, cand, elem, blocks, first, last, cfg.data.reset_positions,
                             tiled_loss=bool(loss_tile), tiled_mlp=bool(mlp_tile),
                             device=device, start=start)
    if last:  # model.mtp's depths, beside the head
        act = replace(act, head=act.head + mtp_activations(
            model, cand, elem, bool(loss_tile), bool(mlp_tile), device,
            cfg.data.reset_positions))
    sh = shard(model, cand.tp, cand.pp, index, cand.ep)
    zero_state = ZeroState(sh, zero, cand.dp * cand.cp, bf16, device, cand.ep)
    resident = zero_state.resident()
    host = {f"{k} (optimizer offload)": v for k, v in zero_state.host().items()}
    host_step = zero_state.host(step=True).get("optimizer temporaries", 0.0)

    # Saved activations on the device; offloaded ones on the host but for two blocks'.
    saved = list(act.layers)
    if cand.offload_activations:
        host["activations (offloaded)"] = sum(saved)
        keep = sorted(saved)[-2:]
        saved = [0.0] * (len(saved) - len(keep)) + keep
    in_flight = min(cand.pp - index, grad_accum) if cand.pp > 1 else 1
    if cand.offload_activations:
        host["activations (offloaded)"] *= in_flight
    others = {"activations, other micro-batches": (in_flight - 1) * (sum(saved) + act.embed
                                                                      + act.head)}
    # Gradients are kept between micro-batches (the last one's backward adds to them)
    accumulating = grad_accum > 1 and cand.pp == 1
    accumulated = {"grads (accumulated)": zero_state.backward(1.0).get("grads", 0.0)} \
        if accumulating else {}
    held = kv_held(cfg, cand, shapes, elem, start, blocks)
    base = {**resident, **zero_state.gathered(), **others, **held["during"]}
    layers = layer_attention(model)[start:start + blocks]
    kinds = {(a.sliding_window, a.chunk_size): a for a in layers
             if a.token_mixer in ("attention", "mla", "dsa", "compressed")}
    halo = [comm_bytes.halo_received(model, cand, a) for a in kinds.values()]
    # the linear mixers' working set: what one makes in its forward (saved or, replayed
    # and under no_grad, alive while it runs) and again as gradients in its backward
    s = shapes
    mixers = [(a.kind, linear_shapes(model, a.kind, cand.tp)) for a in layers
              if a.token_mixer in LINEAR_MIXERS]
    args = (s.B, s.N // s.B, elem, cand.cp, cand.linear_cp, cand.token_layout, device)
    if cand.linear_tile:  # tiled: the boundary states saved, one tile's block at work
        linear = max([tiled_saved(kind, sh, s.B, s.N // s.B, cand.cp, cand.token_layout,
                                  cand.linear_tile, s.d, elem) for kind, sh in mixers],
                     default=0)
        linear_kernel = max([tiled_working_set(kind, sh, s.B, s.N // s.B, elem, cand.cp,
                                               cand.token_layout, device, cand.linear_tile,
                                               s.d) for kind, sh in mixers], default=0)
    else:
        linear = max([mixer_saved(kind, sh, *args) for kind, sh in mixers], default=0)
        # and its kernel's backward beyond that (the lean torch kernel's segment, or the
        # GPU library's whole-sequence backward: linear_layers.mixer_working_set)
        linear_kernel = max([mixer_working_set(kind, sh, *args) for kind, sh in mixers],
                            default=0)
    return Stage(cfg, cand, shapes, elem, last, device, counts.layer_modes(cand, blocks), act,
                 saved, zero_state, sh, resident, base, accumulated, accumulating, host,
                 host_step, loss_tile, mlp_tile, halo, linear, linear_kernel,
                 [a.kind for a in layers] if model.layer_types is not None else [],
                 [moe for _, moe in counts.blocks(model, start, blocks)]
                 if mixed_mlps(model) else [], held["after"])


def kv_held(cfg: Config, cand: Candidate, s: counts.RankShapes, elem: int, start: int,
            blocks: int) -> Dict[str, Dict[str, float]]:
    """{'during': the forward's and backward's terms, 'after': the later phases'} of what
    Gemma 4's layers keep on their modules (kv_held.py): the shared-K/V producers' K/V and
    exchanged copies, the k_eq_v layers' whole-sequence cos/sin; none of a term that is 0."""
    kv = shared_kv_held(cfg.model, cand, s.N, elem, start, blocks)
    rotary = sequence_rotary_held(cfg.model, cand, s.B, cfg.data.reset_positions)
    out = {}
    for when in ("during", "after"):
        terms = {"shared K/V (held)": kv[when], "sequence cos/sin (k_eq_v)": rotary}
        out[when] = {k: v for k, v in terms.items() if v}
    return out


def forward_phases(st: Stage) -> List[Phase]:
    """The forward at its last block (its working set: a replayed block's intermediates or
    a tiled MLP's tile, or the CP attention's buffers) and, on the last stage, at the loss
    (the logits beside the saved softmax)."""
    s, cand, elem, mode = st.shapes, st.cand, st.elem, st.modes[-1]
    kind = st.cfg.model.mlp  # its (N, f) intermediates: mlp_widths
    # a last block without attention (Nemotron-H's MLP-only one) holds no q, k, v
    held = "none" if st.types and LAYER_MIXERS[st.types[-1]][0] is None else mode
    block = max(transients.block_forward(s, cand, held, kind, elem, st.mlp_tile, moe,
                                         st.cfg.model) for moe in moe_forwards(st)) \
        if mode != "none" else transients.mlp_forward(s, kind, elem, st.mlp_tile)
    attention = max([transients.attention_forward(s, cand, elem, h, st.cfg.model,
                                                  mode == "full") for h in set(st.halo)],
                    default=0.0)
    if mode in ("none", "selective") and st.cfg.model.mla is not None:  # MLA's, large:
        # charged before the kernel's out is copied to the saved one (alone) and, in mode
        # none, before the block's MLP part is saved (norm + MLP, as the backward's
        # attention point frees it)
        attention -= mla_layers.saved_after_peak(s, cand, elem, st.cfg.model)
        if mode == "none":
            attention -= counts.norm_saved(s, elem, st.cfg.model.norm, st.device) \
                + counts.channel_saved(s, elem, cand, st.block_model(len(st.modes) - 1),
                                       bool(st.mlp_tile))
    # a replayed linear mixer: its saved set beside its kernel's forward (half its backward's)
    working_set = max(block, attention,
                      st.linear + st.linear_kernel // 2 if mode != "none" else 0)
    phases = [Phase("forward (last block)", {
        **st.base, **st.accumulated, "activations": sum(st.saved) + st.act.embed,
        "block working set": working_set})]
    if st.last:
        phases.append(Phase("forward (loss)", {
            **st.base, **st.accumulated,
            "activations": sum(st.saved) + st.act.embed + st.act.head,
            "logits": transients.loss_forward(s, elem, st.loss_tile)}))
    return phases


def head_gradients(st: Stage):
    """(bytes, elements): a tied head's weight gradient waits in autograd's buffer until
    the embedding adds its part (bytes, not yet the parameter's); an untied head's is the
    parameter's at once (elements of the stage's gradients). Both 0 off the last stage."""
    head = counts.head_params(st.cfg.model, st.cand.tp) if st.last else 0
    tied = st.cfg.model.tie_embeddings and st.cand.pp == 1
    return (head * st.elem if tied else 0.0), (0 if tied else head)


def loss_backward_phase(st: Stage) -> Phase:
    """The loss's backward: everything saved, the loss's gradient, the head's gradients."""
    pending, head_grads = head_gradients(st)
    return Phase("backward (loss)", {
        **st.base, **st.grads(head_grads / st.shard.psi),
        "activations": sum(st.saved) + st.act.embed + st.act.head,
        "logits": transients.loss_backward(st.shapes, st.elem, st.loss_tile),
        "activation grads": st.residual_grad + pending})


def moe_forwards(st: Stage) -> list:
    """Each MLP kind of the stage's blocks at its no-grad forward: a MoE layer's working
    set at its experts (moe_layers.forward_working_set), None for a dense MLP; the phases
    charge the larger (with dense and MoE blocks, either may be the one running)."""
    m, s = st.cfg.model, st.shapes
    kinds = set(st.moe_blocks) if st.moe_blocks else {m.moe is not None}
    return [forward_working_set(s.N, s.d, st.elem, m, st.cand.ep, moe_tile(st)) if moe
            else None for moe in sorted(kinds)]


def moe_tile(st: Stage) -> int:
    """Tokens per tile of the stage's MoE layers (0: untiled): models/moe.py's own rule."""
    if not st.mlp_tile or st.cfg.model.moe is None:
        return 0
    return expert_tile(st.shapes.N, st.shapes.d, st.cfg.model, st.cand.tp,
                       st.cfg.memory.mlp_tile_tokens)


def mlp_backward_working_set(st: Stage, i: int) -> float:
    """Block i's MLP backward (the SwiGLU's gradients, a tiled MLP's tile, or a MoE's
    rows' gradients: moe_layers.backward_working_set) or, just after it, the MLP's dx
    beside the second norm's backward and the MLP's weight gradients a tiled MLP has not
    charged: the larger."""
    model, s, elem, cand = st.block_model(i), st.shapes, st.elem, st.cand
    mlp = counts.mlp_params(model, cand.tp, cand.ep)
    down = counts.down_proj_params(model, cand.tp)
    during = transients.mlp_backward(s, model.mlp, elem, st.mlp_tile, mlp, down,
                                     clamp_saved(model)) \
        if model.moe is None else backward_working_set(s.N, s.d, elem, model, cand.tp, cand.ep,
                                                       moe_tile(st))
    after = transients.after_mlp_backward(s, elem, model.norm, st.device,
                                          (mlp - (0 if st.mlp_tile else down)) * elem)
    return max(during, after)


def block_backward_phase(st: Stage, name: str, i: int, grads_above: float,
                         saved_below: float) -> Phase:
    """Block i's backward at its larger point: the MLP's (everything of the block saved
    or replayed, the SwiGLU's gradients) or the attention's (the MLP part freed, the
    block's gradients but q/k/v's produced, the attention's buffers and dout).
    grads_above: parameter elements whose gradients exist already; saved_below: the
    saved bytes of the blocks the backward has not reached."""
    model, s, cand, elem, mode = st.cfg.model, st.shapes, st.cand, st.elem, st.modes[i]
    pending, _ = head_gradients(st)
    psi, layer = st.shard.psi, counts.layer_params(model, cand.tp, cand.ep)
    norm = counts.norm_saved(s, elem, model.norm, st.device)
    mlp_saved = counts.channel_saved(s, elem, cand, st.block_model(i), bool(st.mlp_tile))
    mlp_part = norm + mlp_saved  # norm2 + MLP: freed before the attention's backward
    replayed = transients.recompute(s, cand, elem, mode, mlp_saved, norm, model)
    kind = st.types[i] if st.types else None
    if mode == "full" and (kind in KINDS or None in LAYER_MIXERS.get(kind, ("", ""))):
        # a linear block or a single-op one (Nemotron-H's attention-only and MLP-only
        # blocks): its whole 'none' bytes, not an attention-and-MLP layer's
        replayed = counts.block_activations(s, elem, cand, "none", kind, model, bool(st.mlp_tile),
                                            st.device) - s.N * s.d * elem
    down = 0 if st.mlp_tile else counts.down_proj_params(model, cand.tp)  # tiled: in its set
    at_mlp = {**st.base, **st.grads((grads_above + down) / psi),
              "activations": saved_below + st.act.embed + st.act.layers[i],
              "recompute": replayed, "layer working set": mlp_backward_working_set(st, i),
              "activation grads": st.residual_grad + pending}
    own = st.act.layers[i] - (mlp_part if mode == "none" else 0.0)
    # the attention's output gradient (N, h, hd; MLA's at v_head_dim)
    attention_out = s.N * s.h * (model.mla.v_head_dim if model.mla else s.hd) * elem
    at_attention = {
        **st.base, **st.grads((grads_above + layer - counts.qkv_params(model, cand.tp)) / psi),
        "activations": saved_below + st.act.embed + own,
        "recompute": replayed - mlp_part if mode == "full" else 0.0,
        "layer working set": max(max([transients.attention_backward(s, cand, elem, h, model)
                                      for h in set(st.halo)], default=0.0) + attention_out,
                                 # a replayed linear block's saved set is charged as its
                                 # recompute; its kernel's backward comes on top
                                 (st.linear if mode != "full" else 0) + st.linear_kernel),
        "activation grads": st.residual_grad + pending}
    best = max(at_mlp, at_attention, key=lambda t: sum(t.values()))
    return Phase(f"{name}, {'MLP' if best is at_mlp else 'attention'})", best)


def block_backward_phases(st: Stage) -> List[Phase]:
    """The first block the backward reaches (the stage's last, every other block's
    activations still saved) and the last it reaches (block 0, nearly every gradient made)."""
    _, head_grads = head_gradients(st)
    blocks, layer = len(st.modes), counts.layer_params(st.cfg.model, st.cand.tp, st.cand.ep)
    phases = [block_backward_phase(st, "backward (first block", blocks - 1, head_grads,
                                   sum(st.saved[:-1]))]
    if blocks > 1:
        phases.append(block_backward_phase(st, "backward (last block", 0,
                                           head_grads + (blocks - 1) * layer, 0.0))
    return phases


def eval_head(s: counts.RankShapes, e: int, tile: int) -> float:
    """The tiled evaluation head at its peak (memory/tiled_eval.py, tiled whatever
    memory.tiled_loss says): one tile's (n, V/tp) logits in the model's dtype and the fp32
    exp of them the cross entropy makes (in place after that; a 16-bit TP argmax's fp32
    copy comes after the softmax is gone)."""
    return min(tile, s.N) * s.V * (e + 4)


def evaluation_phase(st: Stage) -> Phase:
    """An evaluation between steps: the model state (ZeRO-3's parameters gathered as in the
    forward), no activations saved (no_grad), and the larger of its two points: a block's
    forward, where Block.forward holds q, k, v and the attention's output beside the MLP's
    intermediates whatever the checkpointing mode (transients.block_forward's 'full'), or
    the CP attention's buffers; on the last stage, the head: the final-normed hidden states
    (N, d), one loss tile (memory.loss_tile_tokens' rule) and the fp32 losses and int64
    predictions (N)."""
    s, elem = st.shapes, st.elem
    block = max(max(transients.block_forward(s, st.cand, "full", st.cfg.model.mlp, elem,
                                             st.mlp_tile, moe, st.cfg.model)
                    for moe in moe_forwards(st)),
                max([transients.attention_forward(s, st.cand, elem, h, st.cfg.model, True)
                     for h in set(st.halo)], default=0.0), st.linear + st.linear_kernel // 2)
    state = {**st.resident, **st.zero_state.gathered(), **st.held_after}
    at_block = {**state, "block working set": block}
    if not st.last:
        return Phase("evaluation", at_block)
    from ..memory.tiled_loss import loss_tile_tokens
    tile = loss_tile_tokens(s.N, s.V, s.d, st.cfg.memory.loss_tile_tokens)
    at_head = {**state, "hidden states": s.N * s.d * elem,
               "eval head tile": eval_head(s, elem, tile), "eval results": s.N * (4 + 8)}
    return Phase("evaluation", max(at_block, at_head, key=lambda t: sum(t.values())))


def stage_memory(cfg: Config, cand: Candidate, bf16: bool, grad_accum: int, stage_index: int,
                 device: str, zero: Dict) -> Memory:
    """Every phase of pipeline stage `stage_index`'s step, in the order the program runs
    them (the module docstring); zero: ds_zero(cfg, cand)."""
    st = stage(cfg, cand, bf16, grad_accum, stage_index, device, zero)
    phases = forward_phases(st)
    if st.last:
        phases.append(loss_backward_phase(st))
    phases += block_backward_phases(st)
    # Offloaded activations on the host: every block's from the end of the forward until
    # the backward reaches it; at the last block only the two restored ones' copies remain.
    offloaded = st.host.get("activations (offloaded)", 0.0)
    for phase in phases:
        phase.host = sum(st.saved) if phase.name.startswith("backward (last") and offloaded \
            else offloaded
    phases.append(Phase("gradient reduction", {**st.resident, **st.zero_state.reduction(),
                                               **st.held_after}))
    phases.append(Phase("optimizer step", {**st.resident, **st.zero_state.step(),
                                           **st.held_after}))
    phases.append(evaluation_phase(st))
    return Memory(phases, st.host, st.host_step)


def memory(cfg: Config, cand: Candidate, bf16: bool, grad_accum: int,
           device: str = "cuda", zero: Dict = None) -> Memory:
    """Memory of the most loaded rank (pipeline stage 0, or the last with a big head);
    zero: ds_zero(cfg, cand) when the caller has it (it does not depend on seq_len)."""
    zero = zero or ds_zero(cfg, cand)
    best = None
    for index in sorted({0, cand.pp - 1}):
        mem = stage_memory(cfg, cand, bf16, grad_accum, index, device, zero)
        if best is None or mem.peak > best.peak:
            best = mem
    return best


def model_state(psi: int, zero: int, D: int, bf16: bool, reduce_bucket: int,
                largest_layer: int = 0) -> Dict[str, float]:
    """Bytes of params, fp32 master and Adam state one rank holds between steps (and, for
    ZeRO-3, its fp32 gradient partition and the bucket), as tests/test_plan.py measures
    them after a step (CUDA's whole bucket)."""
    sh = Shard(psi, psi, psi, largest_layer)
    st = ZeroState(sh, {"stage": zero, "reduce_bucket_size": reduce_bucket,
                        "stage3_max_live_parameters": 0}, D, bf16, "cuda")
    r = st.resident()
    return dict(params=r.get("params", 0.0), master=r.get("master", 0.0),
                optimizer=r.get("optimizer", 0.0), grads=r.get("grad partition", 0.0),
                buckets=r.get("buckets", 0.0))
