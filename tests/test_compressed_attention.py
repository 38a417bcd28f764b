"""DeepSeek-V4's heavily compressed attention (HCA) core under CP (hca_attention) against
transformers' own DeepseekV4HCACompressor and eager_attention_forward (with the sinks) on
the same weights: at cp1, and at cp2 and cp4 in one spawned world of four ranks, ring and
all-gather, zigzag and contiguous, local shares that are and are not multiples of m, the
full length not a multiple of m (a trailing partial window), packed documents (against
transformers on each document alone: documents across rank and window boundaries and
shorter than m, the two samples' equal and different). Outputs and every gradient
(q, the K=V head, the sinks, the compressor's kv_proj, gate_proj, position_bias and
kv_norm weight); the bytes each rank sends are the entries' all-gather, the windows'
halos and the sliding window's halo, nothing else; bad input raises before any collective.
CSA's compressor entries (compressed_entries(overlap=True)) against transformers'
DeepseekV4CSACompressor: the entries and its weights' gradients at cp1 (at cp2 and cp4
through the whole CSA layer: tests/test_csa_attention.py).

Tolerances (fp32): the reference does one softmax over [window ; entries ; sink], ctxpar
merges blocks by log-sum-exp and sums halo gradients on another rank: the same math in
another order, differences seen ~1e-6 on O(1) values, so 1e-5 (relative, and absolute
against the tensor's largest entry for the weights' gradients summed over every token)
catches any real error (a window compressed from the wrong rows, an entry visible one
window early, a lost halo gradient all move results by O(0.1)).
"""
import types

import pytest
import torch
import torch.distributed as dist
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from ctxpar.context_parallel import cp_stats
from ctxpar.context_parallel.comm import NoComm
from ctxpar.context_parallel.compressed import hca_attention
from ctxpar.context_parallel.compressor import compressed_entries
from ctxpar.context_parallel.layouts import rank_positions
from ctxpar.testing import run_distributed
from ctxpar.testing.compressed import call_bytes, close
from ctxpar.testing.compressed import entry_rope as compressor_rope

B, H, D, HIDDEN, M, WINDOW = 2, 2, 8, 16, 4, 5
# (P, layout, local_seq, comm, documents): shares and slabs that are and are not multiples
# of M; the contiguous cp2 case of 11 tokens leaves a trailing partial window (n = 22).
# The cp2 cases run two at a time, one on each pair of ranks. Documents (boundaries per
# sample) across rank and window boundaries, shorter than M, the two samples' the same
# or not (the core then runs sample by sample).
DOCS_A, DOCS_B = [0, 3, 13, 22, 24], [0, 9, 10, 24]
CP2_CASES = [[(2, "contiguous", 12, "ring", None), (2, "contiguous", 11, "ring", None),
              (2, "contiguous", 12, "ring", [DOCS_A] * 2)],                  # ranks 0, 1
             [(2, "zigzag", 12, "ring", None), (2, "zigzag", 10, "allgather", None),
              (2, "zigzag", 12, "ring", [DOCS_A, DOCS_B])]]                  # ranks 2, 3
CP4_CASES = [(4, "contiguous", 6, "ring", None), (4, "contiguous", 8, "allgather", None),
             (4, "zigzag", 10, "ring", None), (4, "zigzag", 8, "ring", None),
             (4, "contiguous", 6, "ring", [DOCS_A, DOCS_B]),
             (4, "zigzag", 10, "allgather", [[0, 7, 9, 26, 40]] * 2)]

def config():
    rope = {"rope_type": "default", "partial_rotary_factor": 0.5}
    return DeepseekV4Config(
        hidden_size=HIDDEN, head_dim=D, num_attention_heads=H, sliding_window=WINDOW,
        q_lora_rank=8, index_head_dim=8, index_n_heads=2, index_topk=4,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": M},
        rope_parameters={"main": {**rope, "rope_theta": 10000.0},
                         "compress": {**rope, "rope_theta": 160000.0}})


def case_inputs(n, seed=0):
    """The compressor (transformers', random weights) and full-sequence inputs."""
    torch.manual_seed(seed)
    cfg = config()
    comp = hf.DeepseekV4HCACompressor(cfg).float()
    with torch.no_grad():
        for p in comp.parameters():
            p.normal_(0, 0.5)
    hidden, q, kv = torch.randn(B, n, HIDDEN), torch.randn(B, n, H, D), torch.randn(B, n, D)
    sinks = torch.nn.Parameter(torch.randn(H))
    return cfg, comp, hidden, q, kv, sinks, torch.randn(B, n, H, D)


def entry_rope(comp):
    """The compressor's own RoPE at the entries' positions."""
    return compressor_rope(comp.rotary_emb, hf.apply_rotary_pos_emb)


def grads(out, dout, q, kv, sinks, comp):
    return torch.autograd.grad(out, [q, kv, sinks, *comp.parameters()], dout)


def attend(cfg, comp, hidden, q, kv, sinks):
    """transformers on one sequence (or one document alone): the compressor's entries
    and block_bias beside a sliding causal mask, through eager_attention_forward with the
    sinks. (B, n, H, D)."""
    b, n = q.shape[:2]
    entries, block_bias = comp(hidden, None, torch.arange(n)[None].expand(b, -1), None, 0)
    i = torch.arange(n)
    seen = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW)
    mask = torch.zeros(n, n).masked_fill(~seen, float("-inf")).expand(b, 1, n, n)
    keys = kv.unsqueeze(1)
    if block_bias is not None:  # a document shorter than m has no entry
        mask, keys = torch.cat([mask, block_bias], dim=-1), torch.cat([keys, entries], dim=2)
    module = types.SimpleNamespace(num_key_value_groups=H, sinks=sinks, training=False)
    out, _ = hf.eager_attention_forward(module, q.transpose(1, 2), keys, keys, mask,
                                        cfg.head_dim ** -0.5)
    return out


def reference(n, cu=None):
    """transformers on the whole sequence, or with documents (cu: one boundary list per
    sample) on each document alone: (out, grads)."""
    cfg, comp, hidden, q, kv, sinks, dout = case_inputs(n)
    q, kv = q.requires_grad_(), kv.requires_grad_()
    if cu is None:
        out = attend(cfg, comp, hidden, q, kv, sinks)
    else:
        out = torch.cat([torch.cat([attend(cfg, comp, hidden[b:b + 1, s:e], q[b:b + 1, s:e],
                                           kv[b:b + 1, s:e], sinks)
                                    for s, e in zip(c[:-1], c[1:])], dim=1)
                         for b, c in enumerate(cu)])
    return out.detach(), grads(out, dout, q, kv, sinks, comp)


def run(n, pos, group, layout, comm, backend="math", cu=None):
    """hca_attention on the tokens at `pos`: (out, grads of local q/kv and the local
    shares of the sinks' and compressor's); cu: per-sample document boundaries."""
    cfg, comp, hidden, q, kv, sinks, dout = case_inputs(n)
    q, kv = q[:, pos].requires_grad_(), kv[:, pos].requires_grad_()
    h = hidden[:, pos]
    docs = None if cu is None else [torch.tensor(c, dtype=torch.int32) for c in cu]
    out = hca_attention(q, kv, comp.kv_proj(h), comp.gate_proj(h), comp.position_bias,
                        comp.kv_norm.weight, sinks, sliding_window=WINDOW, compress_rate=M,
                        entry_rope=entry_rope(comp), cp_group=group, layout=layout,
                        comm=comm, norm_eps=cfg.rms_norm_eps, backend=backend,
                        cu_seqlens=docs)
    return out.detach(), grads(out, dout[:, pos], q, kv, sinks, comp)


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_hca_matches_transformers_cp1(backend):
    n = 22  # five windows of 4 and a trailing partial one
    want_out, want = reference(n)
    out, got = run(n, torch.arange(n), None, "contiguous", "ring", backend)
    close(out, want_out)
    for g, w in zip(got, want):
        close(g, w)


def test_hca_documents_cp1():
    """Packed documents, the two samples' different: equal to transformers on each
    document alone."""
    n, cu = 24, [DOCS_A, DOCS_B]
    want_out, want = reference(n, cu)
    out, got = run(n, torch.arange(n), None, "contiguous", "ring", cu=cu)
    close(out, want_out)
    for g, w in zip(got, want):
        close(g, w)


def csa_entries(n, pos, group, layout):
    """(entries, gradients of the compressor's four weights) from transformers'
    DeepseekV4CSACompressor (group "reference": its forward on the whole sequence) or
    ctxpar's compressed_entries(overlap=True) on the tokens at `pos`."""
    torch.manual_seed(1)
    cfg = config()
    comp = hf.DeepseekV4CSACompressor(cfg).float()
    with torch.no_grad():
        for p in comp.parameters():
            p.normal_(0, 0.5)
    hidden, q_res = torch.randn(B, n, HIDDEN), torch.randn(B, n, cfg.q_lora_rank)
    dout = torch.randn(B, n // M, D)
    weights = [comp.kv_proj.weight, comp.gate_proj.weight, comp.position_bias,
               comp.kv_norm.weight]
    if group == "reference":
        entries = comp(hidden, q_res, torch.arange(n)[None].expand(B, -1), None, 0)[0][:, 0]
    else:
        h = hidden[:, pos]
        entries = compressed_entries(comp.kv_proj(h), comp.gate_proj(h), comp.position_bias,
                                     comp.kv_norm.weight, cfg.rms_norm_eps, M,
                                     entry_rope(comp), layout, group, overlap=True)
    return entries.detach(), torch.autograd.grad(entries, weights, dout)


def test_csa_entries_match_transformers_cp1():
    n = 22
    want_entries, want = csa_entries(n, None, "reference", None)
    got_entries, got = csa_entries(n, torch.arange(n), None, "contiguous")
    close(got_entries, want_entries)
    for g, w in zip(got, want):
        close(g, w)


def _cp_cases(rank, world):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for P, layout, S, comm, cu in CP2_CASES[rank // 2] + CP4_CASES:
        group = None if P == 4 else pairs[rank // 2]
        r = rank if P == 4 else rank % 2
        n = S * P
        want_out, want = reference(n, cu)
        pos = rank_positions(n, r, P, layout)
        with cp_stats() as st:
            out, got = run(n, pos, group, layout, comm, cu=cu)
        where = f"P={P} {layout} S={S} {comm} documents {cu} rank {r}"
        sent = (st.fwd_bytes_sent, st.bwd_bytes_sent)
        assert sent == call_bytes(P, layout, S, r, M, False, B, [D], WINDOW, cu), (where, sent)
        close(out, want_out[:, pos])
        close(got[0], want[0][:, pos])
        close(got[1], want[1][:, pos])
        for g, w in zip(got[2:], want[2:]):  # the shares of the parameters' gradients
            g = g.clone()
            dist.all_reduce(g, group=group)
            close(g, w)
    return True


def test_compressed_cp2_cp4_match_transformers():
    assert all(run_distributed(_cp_cases, 4, timeout=60))


@pytest.mark.parametrize("kw, match", [
    (dict(layout="striped"), "layout='striped'"),
    (dict(comm="ulysses"), "comm='ulysses'"),
    (dict(compress_rate=0), "compress_rate=0"),
    (dict(compress_rate=8), "compress_rate=8 needs slabs of at least 8 tokens"),
    (dict(cu_seqlens=torch.tensor([0, 12, 20], dtype=torch.int32)),
     r"cu_seqlens\[0\]=\[0, 12, 20\] must start at 0 and end at the sequence length 24"),
])
def test_hca_bad_input_refused_before_communicating(kw, match):
    """NoComm(0, 2) stands in for a two-rank group: the checks run first, locally, so
    nothing is sent (a real group would raise the same on every rank)."""
    n = 12
    cfg, comp, hidden, q, kv, sinks, _ = case_inputs(n)
    args = dict(sliding_window=WINDOW, compress_rate=M, entry_rope=entry_rope(comp),
                cp_group=NoComm(0, 2), layout="zigzag", comm="ring")
    args.update(kw)
    bias = comp.position_bias if args["compress_rate"] == M else \
        torch.zeros(max(args["compress_rate"], 1), D)
    with cp_stats() as st, pytest.raises(ValueError, match=match):
        hca_attention(q, kv, comp.kv_proj(hidden), comp.gate_proj(hidden), bias,
                      comp.kv_norm.weight, sinks, **args)
    assert st.fwd_comm_ops == 0


def test_csa_entries_refuse_short_slabs():
    """CSA's halo reaches a window further back: slabs shorter than 2m are refused (one
    line, before the halo exchange), as is a layout whose windows are not on one rank."""
    kv = torch.zeros(B, 12, 2 * D)
    args = (kv, kv, torch.zeros(M, 2 * D), torch.ones(D), 1e-6, M, None)
    with cp_stats() as st:
        with pytest.raises(ValueError, match="needs slabs of at least 8 tokens"):
            compressed_entries(*args, "zigzag", NoComm(0, 2), overlap=True)
        with pytest.raises(ValueError, match="layout='striped'"):
            compressed_entries(*args, "striped", NoComm(0, 2), overlap=True)
    assert st.fwd_comm_ops == 0
