"""DeepSeek-V4's compressed sparse attention (CSA) core under CP (csa_attention, with the
lightning indexer csa_indexer) against transformers' own DeepseekV4Attention of a
"compressed_sparse_attention" layer on the same weights: the layer's output, the indexer's
indices, and the gradient of the hidden states and of every weight (the attention's
projections, norms and sinks, the CSA compressor's four; the indexer's get none in either:
its top-k is discrete) at cp1, and at cp2 and cp4 in one spawned world of four ranks, ring
and all-gather, zigzag and contiguous, local shares and slabs that are and are not
multiples of m, n not a multiple of m (a trailing partial window), queries that see fewer
entries than index_topk, packed documents (against transformers on each document alone;
the samples' documents equal and different; RoPE positions restarting and global), and
tp2 x cp2 with the indexer's heads split over TP (against one process's core). The bytes
each rank sends are the entries' and the indexer keys'
all-gathers and their compressors' halos plus the window's halo, nothing else; bad input
raises before any collective.

Tolerances (fp32) as tests/test_compressed_attention.py's: transformers does one softmax
over [window ; selected entries ; sink], ctxpar merges blocks by log-sum-exp and sums
gradient shares across ranks: differences ~1e-6 on O(1) values, so 1e-5 (absolute against
the largest entry for sums over tokens). Indices compare exactly: the test's indexer has
its heads in +/- pairs (q_b_proj rows of head 2j+1 = -(2j)'s), so relu(q.k) of one of a
pair is nonzero and no two scores of a row tie (random heads tie at 0.0 often, and
torch.topk orders ties arbitrarily).
"""
import pytest
import torch
import torch.distributed as dist
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from ctxpar.context_parallel import cp_stats
from ctxpar.context_parallel.comm import LOCAL, NoComm
from ctxpar.context_parallel.compressed_sparse import csa_attention
from ctxpar.context_parallel.csa_indexer import IndexerInputs, csa_indexer
from ctxpar.context_parallel.documents import document_positions
from ctxpar.context_parallel.layouts import rank_positions
from ctxpar.testing import run_distributed
from ctxpar.testing.compressed import call_bytes, close, csa_layer
from tests.helpers.v4_attention import tiny_v4_attention

B, H, D, HIDDEN, M, WINDOW, TOPK, HI, DI = 2, 2, 8, 16, 4, 5, 3, 2, 8
# (P, layout, local_seq, comm, documents): slabs of at least 2M; shares and slabs that are
# and are not multiples of M; contiguous cp2 of 11 tokens leaves a trailing partial
# window. The cp2 cases run two at a time, one on each pair of ranks. Documents
# (boundaries per sample) across rank and window boundaries, shorter than M, the two
# samples' the same or not (the core then runs sample by sample).
CP2_CASES = [[(2, "contiguous", 12, "ring", None), (2, "contiguous", 11, "allgather", None),
              (2, "contiguous", 12, "ring", [[0, 3, 13, 22, 24]] * 2)],
             [(2, "zigzag", 20, "ring", None), (2, "zigzag", 16, "allgather", None),
              (2, "zigzag", 16, "ring", [[0, 3, 13, 22, 32], [0, 17, 18, 32]])]]
CP4_CASES = [(4, "contiguous", 9, "ring", None), (4, "zigzag", 18, "allgather", None),
             (4, "contiguous", 9, "ring", [[0, 3, 13, 22, 36], [0, 17, 18, 36]]),
             (4, "zigzag", 18, "allgather", [[0, 5, 30, 33, 61, 72]] * 2)]


def layer(n, seed=0):
    """transformers' CSA attention layer (random weights, the indexer's heads in +/-
    pairs), hidden states (B, n, HIDDEN) and an output gradient."""
    torch.manual_seed(seed)
    attn = tiny_v4_attention(
        "compressed_sparse_attention", hidden=HIDDEN, head_dim=D, heads=H, window=WINDOW,
        rates={"compressed_sparse_attention": M, "heavily_compressed_attention": 8},
        index_heads=HI, index_dim=DI, topk=TOPK)
    return attn, torch.randn(B, n, HIDDEN), torch.randn(B, n, HIDDEN)


def grads(out, dout, hidden, attn):
    return torch.autograd.grad(out, [hidden, *attn.parameters()], dout, allow_unused=True)


def layer_out(attn, hidden):
    """transformers on one sequence (or one document alone, positions from 0): (output,
    indices), the model's sliding causal mask as the attention_mask."""
    b, n = hidden.shape[:2]
    pos = torch.arange(n)[None].expand(b, -1)
    rotary = attn.compressor.rotary_emb
    embeddings = {kind: rotary(hidden, position_ids=pos, layer_type=kind)
                  for kind in ("main", "compress")}
    i = torch.arange(n)
    seen = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW)
    mask = torch.zeros(n, n).masked_fill(~seen, float("-inf")).expand(b, 1, n, n)
    out, _ = attn(hidden, embeddings, pos, mask)
    q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
    return out, attn.compressor.indexer(hidden, q_residual, pos, None, 0)


def pad(indices, k):
    return torch.nn.functional.pad(indices, (0, k - indices.shape[-1]), value=-1)


def by_document(attn, hidden, cu):
    """layer_out on each document alone: (output, indices as global entry ids, -1
    padded to min(TOPK, entries) of each sample, then to the widest sample's)."""
    outs, indices = [], []
    for b, c in enumerate(cu):
        first, rows, parts = 0, [], []
        for s, e in zip(c[:-1], c[1:]):
            out, idx = layer_out(attn, hidden[b:b + 1, s:e])
            rows.append(out)
            parts.append(torch.where(idx >= 0, idx + first, -1))
            first += (e - s) // M
        k = min(TOPK, first)
        outs.append(torch.cat(rows, dim=1))
        indices.append(torch.cat([pad(i, k) for i in parts], dim=1))
    k = max(i.shape[-1] for i in indices)
    return torch.cat(outs), torch.cat([pad(i, k) for i in indices])


def reference(n, cu=None):
    """transformers: (output, indices, grads) of the whole sequence, or with documents
    (cu: boundaries per sample) of each document alone."""
    attn, hidden, dout = layer(n)
    hidden.requires_grad_()
    out, indices = layer_out(attn, hidden) if cu is None else by_document(attn, hidden, cu)
    return out.detach(), indices, grads(out, dout, hidden, attn)


def run(n, pos, group, layout, comm, backend="math", cu=None, reset_positions=True):
    """ctxpar (csa_layer) on the tokens at pos: (output, indices, grads of the local
    hidden states and the local shares of the weights'); cu: per-sample documents, the
    RoPE positions restarting at each (reset_positions) or global."""
    attn, hidden, dout = layer(n)
    h = hidden[:, pos].requires_grad_()
    docs, rope_pos = None, pos
    if cu is not None:
        docs = [torch.tensor(c, dtype=torch.int32) for c in cu]
        if reset_positions:
            rope_pos = document_positions(docs, pos)
    out, indices = csa_layer(attn, h, rope_pos, hf.apply_rotary_pos_emb, cp_group=group,
                             layout=layout, comm=comm, backend=backend, cu_seqlens=docs,
                             reset_positions=reset_positions)
    return out.detach(), indices, grads(out, dout[:, pos], h, attn)


def check_grads(got, want, reduce):
    """Every weight's gradient (reduce: sum the ranks' shares); None only where
    transformers' is None (the indexer's weights)."""
    names = ["hidden"] + [name for name, _ in layer(1)[0].named_parameters()]
    for name, g, w in zip(names, got, want):
        assert (g is None) == (w is None) == name.startswith("compressor.indexer."), name
        if g is not None:
            close(reduce(g) if name != "hidden" else g, w)


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_csa_matches_transformers_cp1(backend):
    n = 22  # five windows of 4 and a trailing partial one; early queries see < TOPK
    want_out, want_indices, want = reference(n)
    assert (want_indices == -1).any() and (want_indices >= 0).all(-1).any()
    out, indices, got = run(n, torch.arange(n), None, "contiguous", "ring", backend)
    close(out, want_out)
    assert torch.equal(indices, want_indices)
    check_grads(got, want, lambda g: g)


@pytest.mark.quick
@pytest.mark.parametrize("reset_positions", [True, False])
def test_csa_documents_cp1(reset_positions):
    """Packed documents, the two samples' different (a document shorter than M, windows
    across boundaries): equal to transformers on each document alone, with the RoPE
    positions restarting at each document or global (RoPE is relative: the entries then
    rotate at their global positions too)."""
    n, cu = 24, [[0, 3, 13, 22, 24], [0, 9, 10, 24]]
    want_out, want_indices, want = reference(n, cu)
    out, indices, got = run(n, torch.arange(n), None, "contiguous", "ring", cu=cu,
                            reset_positions=reset_positions)
    close(out, want_out)
    assert torch.equal(indices, want_indices)
    check_grads(got, want, lambda g: g)


def _cp_cases(rank, world):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for P, layout, S, comm, cu in CP2_CASES[rank // 2] + CP4_CASES:
        group = None if P == 4 else pairs[rank // 2]
        r = rank if P == 4 else rank % 2
        n = S * P
        want_out, want_indices, want = reference(n, cu)
        pos = rank_positions(n, r, P, layout)
        with cp_stats() as st:
            out, indices, got = run(n, pos, group, layout, comm, cu=cu)
        where = f"P={P} {layout} S={S} {comm} documents {cu} rank {r}"
        sent = (st.fwd_bytes_sent, st.bwd_bytes_sent)
        assert sent == call_bytes(P, layout, S, r, M, True, B, [D, DI], WINDOW, cu), \
            (where, sent)
        close(out, want_out[:, pos])
        assert torch.equal(indices, want_indices[:, pos]), where
        want = (want[0][:, pos], *want[1:])

        def reduce(g):
            g = g.clone()
            dist.all_reduce(g, group=group)
            return g
        check_grads(got, want, reduce)
    _tp_case(rank, pairs[rank // 2])
    return True


def core_run(n, pos, group, layout, cu, tp_group=None):
    """The core alone (csa_layer core_only), this rank's heads of the TP group: (output,
    indices, grads of the local hidden states and every weight's local share)."""
    attn, hidden, _ = layer(n)
    dout = torch.randn(B, n, H, D, generator=torch.Generator().manual_seed(1))
    tp_rank, tp_size = (dist.get_rank(tp_group), 2) if tp_group is not None else (0, 1)
    heads = slice(tp_rank * H // tp_size, (tp_rank + 1) * H // tp_size)
    h = hidden[:, pos].requires_grad_()
    docs = [torch.tensor(c, dtype=torch.int32) for c in cu]
    out, indices = csa_layer(attn, h, document_positions(docs, pos), hf.apply_rotary_pos_emb,
                             cp_group=group, layout=layout, cu_seqlens=docs,
                             tp_group=tp_group, core_only=True)
    return out.detach(), indices, grads(out, dout[:, pos][:, :, heads], h, attn), heads


def _tp_case(rank, cp_group):
    """tp2 x cp2 (ranks 0, 1 the first TP rank's CP group, 2, 3 the second's): each
    rank's heads, the indexer's split too (its partial scores all-reduced over TP), equal
    to one process's core on every head (held to transformers above); the hidden states'
    gradient summed over TP, the weights' over every rank. The +/- head pairs land one on
    each TP rank, so the all-reduce adds the same two fp32 terms as the one-process sum:
    the indices compare exactly."""
    tp_group = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    n, cu, layout = 32, [[0, 3, 13, 22, 32]] * 2, "zigzag"
    want_out, want_indices, want, _ = core_run(n, torch.arange(n), LOCAL, layout, cu)
    pos = rank_positions(n, rank % 2, 2, layout)
    out, indices, got, heads = core_run(n, pos, cp_group, layout, cu, tp_group)
    close(out, want_out[:, pos][:, :, heads])
    assert torch.equal(indices, want_indices[:, pos])
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), i
        if g is not None:
            g = g.clone()
            dist.all_reduce(g, group=tp_group if i == 0 else None)
            close(g, w[:, pos] if i == 0 else w)


def test_csa_cp2_cp4_match_transformers():
    assert all(run_distributed(_cp_cases, 4, timeout=60))


def _inputs(S, m=M, index_m=M):
    """Zero tensors of the core's and the indexer's shapes (S local tokens)."""
    z = torch.zeros
    index = IndexerInputs(z(B, S, HI, DI), z(B, S, HI), z(B, S, 2 * DI), z(B, S, 2 * DI),
                          z(index_m, 2 * DI), torch.ones(DI))
    return (z(B, S, H, D), z(B, S, D), z(B, S, 2 * D), z(B, S, 2 * D), z(m, 2 * D),
            torch.ones(D), z(H), index)


@pytest.mark.parametrize("kw, match", [
    (dict(index_topk=0), "index_topk=0 must be a positive integer"),
    (dict(compress_rate=0), "compress_rate=0 must be a positive integer"),
    (dict(compress_rate=8), "compress_rate=8 needs slabs of at least 16 tokens"),
    (dict(layout="striped"), "layout='striped'"),
    (dict(comm="ulysses"), "comm='ulysses'"),
    (dict(cu_seqlens=torch.tensor([0, 12, 24], dtype=torch.int32)),
     r"cu_seqlens\[0\]=\[0, 12, 24\] must start at 0 and end at the sequence length 48"),
    (dict(index_m=2), r"index_position_bias must have shape \(4, 16\)"),
])
def test_csa_bad_input_refused_before_communicating(kw, match):
    """NoComm(0, 2) stands in for a two-rank group: the checks run first, locally, so
    nothing is sent (a real group would raise the same on every rank). index_m: the
    indexer's compressor at another rate than the attention's."""
    m = kw.get("compress_rate", M)
    index_m = kw.pop("index_m", max(m, 1))
    args = dict(sliding_window=WINDOW, compress_rate=M, index_topk=TOPK,
                entry_rope=None, cp_group=NoComm(0, 2), layout="zigzag", comm="ring")
    args.update(kw)
    with cp_stats() as st, pytest.raises(ValueError, match=match):
        csa_attention(*_inputs(24, max(m, 1), index_m), **args)
    with cp_stats() as st2, pytest.raises(ValueError, match="index_topk=-1"):
        csa_indexer(_inputs(24)[-1], compress_rate=M, index_topk=-1, entry_rope=None,
                    cp_group=NoComm(0, 2), layout="zigzag")
    assert st.fwd_comm_ops == 0 and st2.fwd_comm_ops == 0


def test_csa_indexer_refuses_mixed_documents():
    """The indexer alone takes one set of documents for the batch (csa_attention runs
    samples with different ones one by one); refused before any collective."""
    docs = [torch.tensor(cu, dtype=torch.int32) for cu in ([0, 20, 48], [0, 48])]
    with cp_stats() as st, pytest.raises(ValueError, match="the same for every sample"):
        csa_indexer(_inputs(24)[-1], compress_rate=M, index_topk=TOPK, entry_rope=None,
                    cp_group=NoComm(0, 2), layout="zigzag", cu_seqlens=docs)
    assert st.fwd_comm_ops == 0
