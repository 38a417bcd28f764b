"""Linear-attention and state-space mixers over a CP group: the public entry points.

    o, final = gated_delta_rule_cp(q, k, v, g, beta, cp_group=g, layout="zigzag",
                                   strategy="state", cu_seqlens=cu, chunk_size=64)
    o, final = kda_cp(q, k, v, g_per_channel, beta, ...)   # Kimi Delta Attention, alike
    y = ssd_cp(x, dt, A, B, C, chunk_size=64, D=D, dt_bias=dt_bias, dt_softplus=True,
               cp_group=g, layout="contiguous", strategy="heads")
    xBC = causal_conv1d_cp(xBC, weight, bias, activation="silu", cp_group=g, layout="zigzag")

strategy   layouts                      what travels per layer (docs: the module docstrings)
state      contiguous, zigzag           each segment's (M, E) summary, all-gathered in fp32:
                                        B*H*|state| x segments, independent of n
heads      contiguous, zigzag, striped  all-to-all of the inputs and the output:
                                        proportional to the local sequence; H % P == 0

Every strategy is exact, forward and backward, with packed documents (cu_seqlens in the
full sequence, as for attention: the state and the conv window restart at each document
start), grouped key heads (GDN, KDA) and B/C groups (Mamba2). Inputs are this rank's tokens in
`layout` (layouts.shard_sequence); outputs likewise, in the inputs' dtype; states fp32.
The short conv before the mixer (conv.py's plan and halo, run here over the kernel
kernels.py picks; causal_conv1d its one-process form) takes a halo of K - 1 tokens from the
ranks before each run of positions, for either strategy.

Gradients of replicated inputs (per-head parameters, the initial state, the conv weight)
are this rank's share: the CP gradient reduction (a sum over CP) completes them. A final
state is returned on every rank; its gradient is that of the sum of every rank's loss.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..comm import LOCAL, group_rank_and_size
from ..documents import check_cu_seqlens, doc_ids
from ..layouts import LAYOUTS, check_layout, rank_positions
from .conv import ACTIVATIONS, HaloExchange, halo_plan
from .gated_delta import check_chunk_size
from ..ulysses import head_shard, ulysses_kv_heads
from .heads import heads_to_sequence, sequence_to_heads
from .kernels import LocalDocs, TorchSSD, get_kernel
from .lean import SEGMENT_CHUNKS
from .ssd import discretize_dt, ssd_parts, ssd_scan
from .state_passing import (SEGMENTS, STATE_LAYOUTS, carries_state, from_segments,
                            pass_states, to_segments)

STRATEGIES = {"state": STATE_LAYOUTS, "heads": LAYOUTS}  # strategy -> layouts it takes
LINEAR_CP_STRATEGIES = tuple(STRATEGIES)


def check_linear_cp(strategy: str, layout: str, num_heads: int, cp_size: int,
                    chunk_size: int, heads_key: str = "num_heads", caller: str = "") -> None:
    """The rules a mixer's CP settings must meet, each a one-line ValueError naming the key
    and values (a config loader calls this before any collective, as the ops do)."""
    where = f"{caller}: " if caller else ""
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}strategy={strategy!r} must be one of "
                         f"{list(LINEAR_CP_STRATEGIES)}")
    check_layout(layout)
    if layout not in STRATEGIES[strategy]:
        raise ValueError(f"{where}strategy={strategy!r} takes layouts "
                         f"{list(STRATEGIES[strategy])}, not layout={layout!r}")
    if strategy == "heads" and num_heads % cp_size:
        raise ValueError(f"{where}strategy='heads' needs {heads_key}={num_heads} divisible "
                         f"by cp_size={cp_size}")
    check_chunk_size(chunk_size, caller or "linear CP")


def _cp_group(group):
    """None is the world when a process group exists, else this lone rank."""
    if group is None and not dist.is_initialized():
        return LOCAL
    return group


def _documents(cu_seqlens, n: int, batch: int, caller: str, device) -> Optional[LocalDocs]:
    """(B, n) long on the host and on `device`: every position's document (None without
    cu_seqlens)."""
    if cu_seqlens is None:
        return None
    cus = check_cu_seqlens(cu_seqlens, n, batch, caller)
    host = torch.stack([doc_ids(cu, torch.arange(n)) for cu in cus])
    return LocalDocs(host, host.to(device))


def _check_local_seq(S: int, layout: str, caller: str) -> None:
    if layout == "zigzag" and S % 2:
        raise ValueError(f"{caller}: layout 'zigzag' needs an even local_seq (two chunks "
                         f"per rank), got {S}")


def _check_shape(name: str, t, shape, caller: str) -> None:
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{caller}: {name} has shape {tuple(t.shape)}, expected "
                         f"{tuple(shape)}")


def gated_delta_rule_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, *, cp_group=None, layout: str = "contiguous",
                        strategy: str = "state", cu_seqlens=None, chunk_size: int = 64,
                        scale: Optional[float] = None,
                        initial_state: Optional[torch.Tensor] = None,
                        output_final_state: bool = False,
                        use_qk_l2norm_in_kernel: bool = False, kernel: str = "auto",
                        recompute_chunks: int = SEGMENT_CHUNKS
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule (Gated DeltaNet) over a CP group: (o, final state or None).

    q, k (B, T/cp, Hk, Dk); v (B, T/cp, Hv, Dv), Hv % Hk == 0 (value head h reads key head
    h // (Hv/Hk), as Qwen3-Next / Qwen3.5 with linear_num_key_heads < linear_num_value_heads);
    g (B, T/cp, Hv) log-decay (<= 0); beta (B, T/cp, Hv). o (B, T/cp, Hv, Dv) in q's dtype;
    initial_state, final state (B, Hv, Dk, Dv) fp32: the state before token 0 and after
    the last token. scale defaults to Dk ** -0.5; use_qk_l2norm_in_kernel normalises q, k
    first (flash-linear-attention's flag; Qwen3-Next sets it). kernel: the local pass's
    (kernels.py: 'auto', 'torch', 'fla'); recompute_chunks: the segments, in chunks, that
    the kernel's backward recomputes one at a time (lean.py; the torch kernel's always,
    a library's when the tokens are more than one segment: gpu_kernels.py).
    """
    return _delta_rule_cp("gated_delta", "gated_delta_rule_cp", q, k, v, g, beta, cp_group,
                          layout, strategy, cu_seqlens, chunk_size, scale, initial_state,
                          output_final_state, use_qk_l2norm_in_kernel, kernel,
                          recompute_chunks)


def kda_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, *, cp_group=None, layout: str = "contiguous",
           strategy: str = "state", cu_seqlens=None, chunk_size: int = 64,
           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
           kernel: str = "auto", recompute_chunks: int = SEGMENT_CHUNKS
           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention over a CP group (kda.py): gated_delta_rule_cp's arguments with
    g (B, T/cp, Hv, Dk), a log-decay per key channel (fla's ``chunk_kda``). The state
    passing is Gated DeltaNet's: the transition diag(exp g_t)-then-(I - beta k k^T) is
    still linear in the state, so the same widened pass gives (M, E), Dk (Dk + Dv) fp32
    values per head and segment. kernel: 'auto', 'torch', 'fla'; recompute_chunks as
    gated_delta_rule_cp's."""
    return _delta_rule_cp("kda", "kda_cp", q, k, v, g, beta, cp_group, layout, strategy,
                          cu_seqlens, chunk_size, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, kernel, recompute_chunks)


def _delta_rule_cp(op, caller, q, k, v, g, beta, cp_group, layout, strategy, cu_seqlens,
                   chunk_size, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, kernel, recompute_chunks):
    """gated_delta_rule_cp and kda_cp: op 'gated_delta' (g per head) or 'kda' (g per key
    channel), the same checks, strategies and kernel interface."""
    group = _cp_group(cp_group)
    P = group_rank_and_size(group)[1]
    (Bsz, S, Hk, Dk), (Hv, Dv) = q.shape, v.shape[2:]
    _check_shape("k", k, q.shape, caller)
    _check_shape("v", v, (Bsz, S, Hv, Dv), caller)
    _check_shape("g", g, (Bsz, S, Hv) + ((Dk,) if op == "kda" else ()), caller)
    _check_shape("beta", beta, (Bsz, S, Hv), caller)
    _check_shape("initial_state", initial_state, (Bsz, Hv, Dk, Dv), caller)
    if Hv % Hk:
        raise ValueError(f"{caller}: linear_num_value_heads={Hv} is not a multiple of "
                         f"linear_num_key_heads={Hk}")
    check_linear_cp(strategy, layout, Hv, P, chunk_size, "linear_num_value_heads", caller)
    _check_local_seq(S, layout, caller)
    doc = _documents(cu_seqlens, S * P, Bsz, caller, q.device)
    scale = Dk ** -0.5 if scale is None else float(scale)
    state = P > 1 and strategy == "state"  # state passing widens v by Dk (_gated_delta_state)
    impl = get_kernel(op, kernel, q, key_dim=Dk, value_dim=Dv + Dk * state)
    check_chunk_size(recompute_chunks, caller)
    kernel = partial(impl, scale=scale, chunk_size=chunk_size,
                     segment_chunks=recompute_chunks,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if P == 1:
        o, final = kernel(q, k, v, g, beta, initial_state=initial_state, docs=doc)
    elif strategy == "heads":
        sent = ulysses_kv_heads(Hk, P)
        vh, gh, bh, qh, kh = sequence_to_heads([v, g, beta, q, k], [Hv, Hv, Hv, sent, sent],
                                               group, layout)
        o, final = kernel(qh, kh, vh, gh, bh, initial_state=head_shard(initial_state, group, 1),
                          docs=doc)                          # (B, T, Hv/cp, Dv)
        if output_final_state:
            o, final = heads_to_sequence(o.to(q.dtype), group, layout, final)
        else:
            o = heads_to_sequence(o.to(q.dtype), group, layout)
    else:
        o, final = _gated_delta_state(q, k, v, g, beta, group, layout, doc, kernel,
                                      initial_state)
    return o.to(q.dtype), (final if output_final_state else None)


def _gated_delta_state(q, k, v, g, beta, group, layout, doc, kernel, initial_state):
    """State passing for GDN and KDA (g per head or per key channel: cut into segments
    alike). One kernel pass per segment from the initial state [I | 0]
    with values [0 | v]: by linearity in (S_in, v) the final state is [M | E] and the
    output is [q~ | o_0], q~_t = M_{1..t}^T (scale q_t), o_0 the output from a zero state;
    the true output is o_0 + q~ S_in once S_in is known (LASP-2's correction). One pass of
    width Dk + Dv, cheaper than fla's CP (a pass from zero, the (Dk, Dk) transitions, a
    second pass from S_in: fla/ops/cp) and exact the same way."""
    rank, P = group_rank_and_size(group)
    (Bsz, S, Hv, Dv), Dk, slots = v.shape, q.shape[-1], SEGMENTS[layout]
    pos = rank_positions(S * P, rank, P, layout, q.device)
    docs = None if doc is None else doc.rows(rank_positions(S * P, rank, P, layout), pos,
                                             partial(to_segments, slots=slots))
    carry = carries_state(pos, None if doc is None else doc.device, Bsz, slots).float()
    eye = torch.eye(Dk, device=q.device) * carry[:, None, None, None]  # (B*slots, 1, Dk, Dk)
    init = torch.cat([eye.expand(-1, Hv, Dk, Dk),
                      torch.zeros(Bsz * slots, Hv, Dk, Dv, device=q.device)], dim=-1)
    vs = to_segments(v, slots)
    v_wide = torch.cat([vs.new_zeros(*vs.shape[:-1], Dk), vs], dim=-1)  # (B*slots, L, Hv, Dk+Dv)
    seg = [to_segments(x, slots) for x in (q, k)] + [v_wide] + \
        [to_segments(x, slots) for x in (g, beta)]
    o_wide, summary = kernel(*seg, initial_state=init, docs=docs)
    q_read, o_zero = o_wide.split([Dk, Dv], dim=-1)                     # (B*slots, L, Hv, .)
    summary = summary.unflatten(0, (Bsz, slots)).transpose(0, 1)       # (slots, B, Hv, Dk, Dk+Dv)
    s0 = torch.zeros(Bsz, Hv, Dk, Dv, device=q.device) if initial_state is None \
        else initial_state.float()
    s_in, final = pass_states(summary, partial(_gdn_combine, Dk), s0, group,
                              layout)                                   # (slots, B, Hv, Dk, Dv)
    s_in = s_in.transpose(0, 1).flatten(0, 1)                           # (B*slots, Hv, Dk, Dv)
    o = o_zero + torch.einsum("blhk,bhkv->blhv", q_read.float(), s_in)
    return from_segments(o, slots), final


def _gdn_combine(Dk: int, summary: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """M S + E for summary [M | E] (B, Hv, Dk, Dk+Dv), S (B, Hv, Dk, Dv)."""
    return summary[..., :Dk] @ S + summary[..., Dk:]


def ssd_cp(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
           C: torch.Tensor, *, chunk_size: int = 64, D: Optional[torch.Tensor] = None,
           dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
           dt_limit: Tuple[float, float] = (0.0, math.inf),
           initial_states: Optional[torch.Tensor] = None, return_final_states: bool = False,
           cp_group=None, layout: str = "contiguous", strategy: str = "state",
           cu_seqlens=None, kernel: str = "auto", recompute_chunks: int = SEGMENT_CHUNKS):
    """Mamba2's SSD over a CP group, mamba_ssm's ``mamba_chunk_scan_combined`` arguments.

    x (b, T/cp, H, P); dt (b, T/cp, H) (through dt_bias, softplus and dt_limit here, on each
    rank's tokens); A (H,) = -exp(A_log); B, C (b, T/cp, G, N), H % G == 0; D, dt_bias (H,).
    y (b, T/cp, H, P) in x's dtype; initial_states, final states (b, H, P, N) fp32. Returns
    y, or (y, final) with return_final_states. kernel: the local pass's (kernels.py: 'auto',
    'torch', 'mamba_ssm'); recompute_chunks as gated_delta_rule_cp's (state passing's torch
    SSD runs in two halves instead, api._ssd_state, and keeps its intermediates).
    """
    caller = "ssd_cp"
    group = _cp_group(cp_group)
    P = group_rank_and_size(group)[1]
    (b, S, H, Pd), (G, N) = x.shape, B.shape[2:]
    _check_shape("dt", dt, (b, S, H), caller)
    _check_shape("C", C, B.shape, caller)
    _check_shape("B", B, (b, S, G, N), caller)
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        _check_shape(name, t, (H,), caller)
    _check_shape("initial_states", initial_states, (b, H, Pd, N), caller)
    if H % G:
        raise ValueError(f"{caller}: num_heads={H} is not a multiple of n_groups={G}")
    check_linear_cp(strategy, layout, H, P, chunk_size, "num_heads", caller)
    _check_local_seq(S, layout, caller)
    doc = _documents(cu_seqlens, S * P, b, caller, x.device)
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)              # (b, T/cp, H) fp32
    check_chunk_size(recompute_chunks, caller)
    kernel = partial(get_kernel("ssd", kernel, x), chunk_size=chunk_size,
                     segment_chunks=recompute_chunks)
    if P == 1:
        y, final = kernel(x, dt, A, B, C, D, initial_states, doc)
    elif strategy == "heads":
        sent = ulysses_kv_heads(G, P)
        xh, dth, Bh, Ch = sequence_to_heads([x, dt, B, C], [H, H, sent, sent], group, layout)
        y, final = kernel(xh, dth, head_shard(A, group), Bh, Ch, head_shard(D, group),
                          head_shard(initial_states, group, 1), doc)  # (b, T, H/cp, P)
        if return_final_states:
            y, final = heads_to_sequence(y.to(x.dtype), group, layout, final)
        else:
            y = heads_to_sequence(y.to(x.dtype), group, layout)
    else:
        y, final = _ssd_state(x, dt, A, B, C, D, group, layout, doc, kernel, initial_states)
    return (y.to(x.dtype), final) if return_final_states else y.to(x.dtype)


def _ssd_state(x, dt, A, B, C, D, group, layout, doc, kernel, initial_states):
    """State passing for Mamba2: the kernel runs each segment from zero (y_0, E); the
    initial state reaches token t decayed by a_t = exp(sum of dt A up to t) while t is
    in the segment's first document (and that continues the state before it), so M = a_T
    and y = y_0 + a_t C_t S_in. The torch SSD does it in two halves instead, with no
    correction pass: its state-independent part (the chunks' own outputs and states,
    ssd.ssd_parts) once, E from the chunk states' scan alone (a few state updates), and
    after the all-gather one scan from S_in that writes the outputs (ssd.ssd_scan)."""
    rank, P = group_rank_and_size(group)
    (b, S, H, Pd), (G, N), slots = x.shape, B.shape[2:], SEGMENTS[layout]
    pos = rank_positions(S * P, rank, P, layout, x.device)
    docs = None if doc is None else doc.rows(rank_positions(S * P, rank, P, layout), pos,
                                             partial(to_segments, slots=slots))
    xs, dts, Bs, Cs = (to_segments(t, slots) for t in (x, dt, B, C))
    split = isinstance(kernel.func, TorchSSD)  # the torch SSD in two halves (docstring)
    if split:  # the state-independent part once; E from the chunk states alone
        xs = xs.float()  # one fp32 copy for both x dt and D x
        parts = ssd_parts(xs, dts, A, Bs, Cs, None if docs is None else docs.device,
                          kernel.keywords["chunk_size"])
        _, E = ssd_scan(parts, xs.new_zeros(b * slots, H, Pd, N, dtype=torch.float32),
                        outputs=False)
    else:
        y_zero, E = kernel(xs, dts, A, Bs, Cs, D, None, docs)           # E (b*slots, H, Pd, N)
    reached = carries_state(pos, None if doc is None else doc.device, b, slots)[:, None]
    if docs is not None:
        seq_idx = docs.device
        reached = reached & (seq_idx == seq_idx[:, :1])                 # (b*slots, L)
    decay_in = (dts * A.float()).cumsum(1).exp() * reached[..., None]   # (b*slots, L, H)
    summary = torch.cat([E.flatten(2), decay_in[:, -1, :, None]], dim=-1)
    summary = summary.unflatten(0, (b, slots)).transpose(0, 1)          # (slots, b, H, Pd*N+1)
    s0 = torch.zeros(b, H, Pd, N, device=x.device) if initial_states is None \
        else initial_states.float()
    s_in, final = pass_states(summary, partial(_ssd_combine, (Pd, N)), s0, group,
                              layout)                                   # (slots, b, H, Pd, N)
    s_in = s_in.transpose(0, 1).flatten(0, 1)                           # (b*slots, H, Pd, N)
    if split:  # one scan from the state that reaches the segment writes every output
        y, _ = ssd_scan(parts, s_in * reached[:, :1, None, None])
        y = y if D is None else y + xs * D.float()[:, None]
        return from_segments(y, slots), final
    C_heads = Cs.float().repeat_interleave(H // G, dim=2)               # (b*slots, L, H, N)
    y = y_zero + decay_in[..., None] * torch.einsum("bhpn,blhn->blhp", s_in, C_heads)
    return from_segments(y, slots), final


def _ssd_combine(state_shape, summary: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """M S + E for summary [E flattened | M] (b, H, Pd*N+1), S (b, H, Pd, N)."""
    return summary[..., -1, None, None] * S + summary[..., :-1].unflatten(-1, state_shape)


def causal_conv1d_cp(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     *, activation: Optional[str] = None, cp_group=None,
                     layout: str = "contiguous", cu_seqlens=None,
                     kernel: str = "auto") -> torch.Tensor:
    """The depthwise causal conv1d before a mixer over a CP group (conv.py): x (B, T/cp, C)
    this rank's tokens, weight (C, K), bias (C,), activation None or 'silu'. Any layout
    (the halo is K - 1 tokens per neighbour for contiguous and zigzag). (B, T/cp, C) in
    x's dtype. kernel: kernels.py's conv ('auto', 'torch', 'causal_conv1d')."""
    caller = "causal_conv1d_cp"
    group = _cp_group(cp_group)
    check_layout(layout)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{caller}: activation={activation!r} must be one of "
                         f"{list(ACTIVATIONS)}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"{caller}: x (B, T/cp, C) {tuple(x.shape)} and weight (C, K) "
                         f"{tuple(weight.shape)} do not match")
    _check_shape("bias", bias, (x.shape[2],), caller)
    _check_local_seq(x.shape[1], layout, caller)
    P = group_rank_and_size(group)[1]
    doc = _documents(cu_seqlens, x.shape[1] * P, x.shape[0], caller, x.device)
    return conv_over_group(x, weight, bias, activation, group, layout,
                           None if doc is None else doc.device, kernel)


def conv_over_group(x, weight, bias, activation, group, layout: str,
                    doc: Optional[torch.Tensor], kernel: str = "auto") -> torch.Tensor:
    """This rank's conv output (B, S, C) in x's dtype; x (B, S, C) this rank's tokens,
    doc (B, n) every position's document or None; kernel: kernels.py's conv ('auto',
    'torch', 'causal_conv1d')."""
    rank, world = group_rank_and_size(group)
    K, (B, S, C) = weight.shape[1], x.shape
    impl = get_kernel("conv", kernel, x, channels=C, width=K)
    plan = halo_plan(layout, S * world, rank, world, K)
    halo = HaloExchange.apply(x, plan, group) if plan.recvs or plan.sends \
        else x.new_zeros(B, 0, C)
    return impl(x, halo, layout, rank, world, doc, weight, bias, activation)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None,
                  seq_idx: Optional[torch.Tensor] = None, kernel: str = "auto") -> torch.Tensor:
    """The depthwise causal conv1d on one process: x (B, T, C), weight (C, K), bias (C,),
    activation None or 'silu'; seq_idx (B, T) documents (non-decreasing) or None.
    (B, T, C) in x's dtype."""
    return conv_over_group(x, weight, bias, activation, LOCAL, "contiguous", seq_idx, kernel)


def summary_bytes(batch: int, heads: int, state: Tuple[int, int], layout: str, cp_size: int,
                  mixer: str) -> int:
    """Bytes one rank sends (and receives) for state passing in each of forward and
    backward: the fp32 summaries of its segments to the P-1 others. state = (Dk, Dv) for
    'gated_delta' and 'kda' ([M | E]: Dk*(Dk+Dv) per head), (P, N) for 'ssd' (E and the
    scalar M)."""
    if mixer not in ("gated_delta", "kda", "ssd"):
        raise ValueError(f"summary_bytes: mixer={mixer!r} must be 'gated_delta', 'kda' "
                         f"or 'ssd'")
    if layout not in SEGMENTS:
        raise ValueError(f"summary_bytes: strategy='state' takes layouts "
                         f"{list(STATE_LAYOUTS)}, not layout={layout!r}")
    a, c = state
    per_head = a * c + 1 if mixer == "ssd" else a * (a + c)
    return (cp_size - 1) * SEGMENTS[layout] * batch * heads * per_head * 4
