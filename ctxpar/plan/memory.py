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

from dataclasses import dataclass, field
from typing import Dict, List

from ..config import Config, deepspeed_config
from . import counts, transients
from .layout import Layout, apply_layout
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


def tile_sizes(cfg: Config, s: counts.RankShapes, lay: Layout):
    """(loss tile, MLP tile) in tokens, 0 when that option is off: the memory modules' own
    rule for 'auto' (ctxpar/memory/tiled_loss.py, tiled_mlp.py)."""
    mem = cfg.memory
    loss = mlp = 0
    if lay.tiled_loss:
        try:
            from ..memory.tiled_loss import loss_tile_tokens
        except ImportError:  # until the module lands: a given size, or one (N, d)'s worth
            def loss_tile_tokens(rows, vocab, d, setting):
                return setting if setting != "auto" else max(1, rows * d // vocab)
        loss = loss_tile_tokens(s.N, s.V, s.d, mem.loss_tile_tokens)
    if lay.tiled_mlp:
        try:
            from ..memory.tiled_mlp import mlp_tile_tokens
        except ImportError:
            def mlp_tile_tokens(tokens, d, ffn, setting):
                return setting if setting != "auto" else max(1, tokens * d // ffn)
        mlp = mlp_tile_tokens(s.N, s.d, s.f, mem.mlp_tile_tokens)
    return loss, mlp


def shard(m, tp: int, pp: int, stage: int) -> Shard:
    psi = counts.stage_params(m, tp, pp, stage)
    return Shard(psi=psi, psi0=psi - counts.stage_vector_params(m, tp, pp, stage),
                 largest=counts.largest_tensor(m, tp), layer=counts.layer_params(m, tp))


def ds_zero(cfg: Config, lay: Layout) -> Dict:
    """zero_optimization as train.py hands it to DeepSpeed for this layout (the same
    ctxpar.config.deepspeed_config), with DeepSpeed's defaults for absent keys."""
    return zero_config(deepspeed_config(apply_layout(cfg, lay), lay.dp))


def stage_memory(cfg: Config, lay: Layout, bf16: bool, grad_accum: int, stage: int,
                 device: str, zero: Dict) -> Memory:
    m, e = cfg.model, 2 if bf16 else 4
    s = counts.rank_shapes(m, lay)
    first, last = stage == 0, stage == lay.pp - 1
    n_layers = m.n_layers // lay.pp + (1 if stage < m.n_layers % lay.pp else 0)
    loss_tile, mlp_tile = tile_sizes(cfg, s, lay)
    act = counts.activations(m, lay, e, n_layers, first, last, cfg.data.reset_positions,
                             tiled_loss=bool(loss_tile), tiled_mlp=bool(mlp_tile),
                             device=device)
    norm = counts.norm_saved(s, e, m.norm, device)
    modes = counts.layer_modes(lay, n_layers)
    sh = shard(m, lay.tp, lay.pp, stage)
    st = ZeroState(sh, zero, lay.dp * lay.cp, bf16, device)
    res = st.resident()
    host = {f"{k} (optimizer offload)": v for k, v in st.host().items()}
    host_step = st.host(step=True).get("optimizer temporaries", 0.0)

    # Saved activations on the device; offloaded ones on the host but for two blocks'.
    saved = list(act.layers)
    if lay.offload_activations:
        host["activations (offloaded)"] = sum(saved)
        keep = sorted(saved)[-2:]
        saved = [0.0] * (len(saved) - len(keep)) + keep
    in_flight = min(lay.pp - stage, grad_accum) if lay.pp > 1 else 1
    if lay.offload_activations:
        host["activations (offloaded)"] *= in_flight
    prev = {"activations, other micro-batches": (in_flight - 1) * (sum(saved) + act.embed
                                                                    + act.head)}
    # Gradients are kept between micro-batches (the last one's backward adds to them)
    accumulating = grad_accum > 1 and lay.pp == 1
    accum = {"grads (accumulated)": st.backward(1.0).get("grads", 0.0)} if accumulating \
        else {}
    base = {**res, **st.gathered(), **prev}

    def grads(frac):
        return st.backward(1.0 if accumulating else frac)

    swiglu = m.mlp == "swiglu"
    mlp_saved = 0.0 if mlp_tile else 4 * s.N * s.f * e
    attn_f = transients.attention_forward(s, lay, e)
    attn_b = transients.attention_backward(s, lay, e)
    mlp_p = counts.layer_params(m, lay.tp) - counts.qkv_params(m, lay.tp) - \
        (s.h * s.hd * s.d + int(m.bias) * s.d) - s.d  # the MLP's weights (o_proj, norm2 off)
    down = counts.down_proj_params(m, lay.tp)
    mlp_b = max(transients.mlp_backward(s, swiglu, e, mlp_tile, mlp_p, down),
                transients.after_mlp_backward(s, e, m.norm, device,
                                              (mlp_p - (0 if mlp_tile else down)) * e))

    phases = []
    # forward: the last block's working set, or the loss
    last_ckpt = modes[-1] != "none"
    block = transients.block_forward(s, lay, modes[-1], swiglu, e, mlp_tile) \
        if last_ckpt else transients.mlp_forward(s, swiglu, e, mlp_tile)
    fwd_block = {"activations": sum(saved) + act.embed, "block working set": max(block, attn_f)}
    phases.append(Phase("forward (last block)", {**base, **accum, **fwd_block}))
    if last:
        phases.append(Phase("forward (loss)", {
            **base, **accum, "activations": sum(saved) + act.embed + act.head,
            "logits": transients.loss_forward(s, e, loss_tile)}))

    # backward: the loss, the first and the last block it reaches, each at its MLP's
    # backward (the block's largest point: its down projection's gradient is there, the
    # rest of the block's not yet). A tied head's weight gradient waits in autograd's
    # buffer until the embedding adds its part (then it becomes the parameter's).
    psi, layer_p = sh.psi, counts.layer_params(m, lay.tp)
    head_p = s.V * s.d if last else 0
    tied = m.tie_embeddings and lay.pp == 1
    pending = head_p * e if tied else 0.0
    head_grads = 0 if tied else head_p
    if last:
        phases.append(Phase("backward (loss)", {
            **base, **grads(head_grads / psi),
            "activations": sum(saved) + act.embed + act.head,
            "logits": transients.loss_backward(s, e, loss_tile),
            "activation grads": s.N * s.d * e + pending}))

    qkv_p = counts.qkv_params(m, lay.tp)
    mlp_part = norm + mlp_saved  # norm2 + MLP: freed before the attention's backward

    def layer_phase(name, i, above, below):
        """Block i's backward at its larger point: the MLP's (everything of the block
        saved or replayed, the SwiGLU's gradients) or the attention's (the MLP part
        freed, the block's gradients but q/k/v's produced, the attention's buffers and
        dout)."""
        rec = transients.recompute(s, lay, e, modes[i], mlp_saved, norm)
        made = 0 if mlp_tile else down  # a tiled MLP's gradients are in its working set
        mlp_pt = {**base, **grads((above + made) / psi),
                  "activations": below + act.embed + act.layers[i], "recompute": rec,
                  "layer working set": mlp_b, "activation grads": s.N * s.d * e + pending}
        own = act.layers[i] - (mlp_part if modes[i] == "none" else 0.0)
        rec_attn = rec - mlp_part if modes[i] == "full" else 0.0
        attn_pt = {**base, **grads((above + layer_p - qkv_p) / psi),
                   "activations": below + act.embed + own, "recompute": rec_attn,
                   "layer working set": attn_b + s.N * s.h * s.hd * e,
                   "activation grads": s.N * s.d * e + pending}
        best = max(mlp_pt, attn_pt, key=lambda t: sum(t.values()))
        return Phase(f"{name}, {'MLP' if best is mlp_pt else 'attention'})", best)

    L = n_layers
    phases.append(layer_phase("backward (first block", L - 1, head_grads, sum(saved[:-1])))
    if L > 1:
        phases.append(layer_phase("backward (last block", 0, head_grads + (L - 1) * layer_p,
                                  0.0))
    # Offloaded activations on the host: every block's from the end of the forward until
    # the backward reaches it; at the last block only the two restored ones' copies remain.
    off = host.get("activations (offloaded)", 0.0)
    for ph in phases:
        ph.host = sum(saved) if ph.name.startswith("backward (last") and off else off
    phases.append(Phase("gradient reduction", {**res, **st.reduction()}))
    phases.append(Phase("optimizer step", {**res, **st.step()}))
    return Memory(phases, host, host_step)


def memory(cfg: Config, lay: Layout, bf16: bool, grad_accum: int,
           device: str = "cuda", zero: Dict = None) -> Memory:
    """Memory of the most loaded rank (pipeline stage 0, or the last with a big head);
    zero: ds_zero(cfg, lay) when the caller has it (it does not depend on seq_len)."""
    zero = zero or ds_zero(cfg, lay)
    best = None
    for stage in sorted({0, lay.pp - 1}):
        mem = stage_memory(cfg, lay, bf16, grad_accum, stage, device, zero)
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
