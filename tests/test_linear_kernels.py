"""The linear mixers' one-process kernels against transformers' torch references.

ctxpar's chunked Gated DeltaNet, KDA, Mamba2 SSD and short conv
(ctxpar/context_parallel/linear/) on the same inputs as transformers' Qwen3-Next / Qwen3.5
``torch_chunk_gated_delta_rule``, Kimi Linear's ``chunk_kimi_delta_attention`` and
``recurrent_kimi_delta_attention``, Mamba2's and Nemotron-H's ``mamba2_chunk_scan`` and
``causal_conv1d_fn``: outputs, final
states and every gradient. transformers has no documents in these paths, so documents are
checked against the reference run document by document (the first from the initial
state, the others from zero). Tolerance: both sides compute in fp32 in a similar order;
the differences seen are ~1e-7 of the tensors' scale, 1e-5 of it is the bound.
"""
import importlib

import pytest
import torch
import torch.nn.functional as F

from ctxpar.context_parallel.linear import (causal_conv1d, chunk_gated_delta_rule, chunk_kda,
                                            kda_step, ssd_chunk_scan)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
kimi_linear = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _hf_gdn(fn):
    """transformers' gated delta functions take query, key, value: ours q, k, v."""
    return lambda q, k, v, **kw: fn(q, k, v, **kw)


def _hf_ssd(fn):
    """transformers' mamba2_chunk_scan takes hidden_states: ours x."""
    return lambda x, **kw: fn(x, **kw)


def close(got, want):
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)


def _gdn_inputs(T=37, Hk=2, Hv=4, Dk=8, Dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(2, T, Hk, Dk), k=r(2, T, Hk, Dk), v=r(2, T, Hv, Dv),
                g=-F.softplus(r(2, T, Hv)), beta=torch.rand(2, T, Hv, generator=gen),
                initial_state=r(2, Hv, Dk, Dv))


def _leaves(inputs):
    return {k: x.clone().requires_grad_() for k, x in inputs.items()}


def _grads(out, final, leaves, seed=1):
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen)).sum() \
        + (final * torch.randn(final.shape, generator=gen)).sum()
    return torch.autograd.grad(loss, list(leaves.values()))


@pytest.mark.quick
def test_chunked_gated_delta_matches_qwen3_next_with_grouped_key_heads():
    """Hk=2 < Hv=4 (Qwen3.5's grouping), l2-normalised q and k, an initial state, 37 tokens
    in chunks of 8 (the last one padded): output, final state and the gradients of q, k,
    v, g, beta and the initial state."""
    ours, ref = _leaves(_gdn_inputs()), _leaves(_gdn_inputs())
    o, f = chunk_gated_delta_rule(**ours, chunk_size=8, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
    ro, rf = _hf_gdn(qwen3_next.torch_chunk_gated_delta_rule)(**ref, chunk_size=8,
                                                              output_final_state=True,
                                                              use_qk_l2norm_in_kernel=True)
    close(o, ro)
    close(f, rf)
    for name, a, b in zip(ours, _grads(o, f, ours), _grads(ro, rf, ref)):
        close(a, b)


def _by_document(fn, inputs, seq_idx, state_key, **kw):
    """fn run on each document of each sample alone: the first document from the initial
    state, later ones from zero; (outputs (B, T, ...), final states)."""
    outs, finals = [], []
    for b, ids in enumerate(seq_idx):
        parts, state = [], inputs[state_key][b:b + 1]
        for d in ids.unique():
            m = ids == d
            one = {k: (x[b:b + 1] if k == state_key else x[b:b + 1, m])
                   for k, x in inputs.items() if x.dim() > 1}
            one[state_key] = state if d == ids[0] else None
            one.update({k: x for k, x in inputs.items() if x.dim() == 1})
            out, state = fn(**one, **kw)
            parts.append(out)
        outs.append(torch.cat(parts, dim=1))
        finals.append(state)
    return torch.cat(outs), torch.cat(finals)


SEQ_IDX = torch.tensor([[0] * 8 + [1] + [2] * 20 + [3] * 8,     # a start on a chunk's first
                        [0] * 13 + [1] * 23 + [2]])             # token, one-token documents


def test_gated_delta_documents_restart_the_state():
    inputs = _gdn_inputs()
    o, f = chunk_gated_delta_rule(**inputs, chunk_size=8, output_final_state=True,
                                  seq_idx=SEQ_IDX, use_qk_l2norm_in_kernel=True)
    ro, rf = _by_document(_hf_gdn(qwen3_next.torch_recurrent_gated_delta_rule), inputs, SEQ_IDX,
                          "initial_state", output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    close(o, ro)
    close(f, rf)


def test_gated_delta_chunk_size_changes_only_rounding():
    inputs = _gdn_inputs()
    runs = [chunk_gated_delta_rule(**inputs, chunk_size=c, output_final_state=True,
                                   seq_idx=SEQ_IDX) for c in (5, 8, 64)]
    for o, f in runs[1:]:
        close(o, runs[0][0])
        close(f, runs[0][1])


def _ssd_inputs(T=37, H=4, P=6, G=2, N=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(2, T, H, P), dt=r(2, T, H) - 1, A_log=torch.rand(H, generator=gen).add(
        0.5).log(), B=r(2, T, G, N), C=r(2, T, G, N), D=r(H), dt_bias=0.5 * r(H),
        initial_states=r(2, H, P, N))


def _ssd(fn, t, **kw):
    args = {k: v for k, v in t.items() if k != "A_log"}
    return fn(**args, A=-t["A_log"].exp(), chunk_size=8, dt_softplus=True,
              return_final_states=True, **kw)


@pytest.mark.parametrize("family", ["mamba2", "nemotron_h"])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.5)])
def test_chunked_ssd_matches_transformers(family, dt_limit):
    """B/C in 2 groups of 4 heads, D, dt_bias, softplus, an initial state, 37 tokens in
    chunks of 8: output, final state and the gradients of x, dt, A_log, B, C, D, dt_bias
    and the initial state."""
    ref_fn = _hf_ssd(importlib.import_module(
        f"transformers.models.{family}.modeling_{family}").mamba2_chunk_scan)
    ours, ref = _leaves(_ssd_inputs()), _leaves(_ssd_inputs())
    y, f = _ssd(ssd_chunk_scan, ours, dt_limit=dt_limit)
    ry, rf = _ssd(ref_fn, ref, dt_limit=dt_limit)
    close(y, ry)
    close(f, rf)
    for a, b in zip(_grads(y, f, ours), _grads(ry, rf, ref)):
        close(a, b)


def test_ssd_documents_restart_the_state():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    t = _ssd_inputs()
    y, f = _ssd(ssd_chunk_scan, t, seq_idx=SEQ_IDX)
    inputs = {k: v for k, v in t.items() if k != "A_log"}
    inputs["A"] = -t["A_log"].exp()
    ry, rf = _by_document(_hf_ssd(mamba2_chunk_scan), inputs, SEQ_IDX, "initial_states",
                          chunk_size=8, dt_softplus=True, return_final_states=True)
    close(y, ry)
    close(f, rf)


def test_causal_conv1d_matches_transformers_and_restarts_at_documents():
    """Output and the gradients of x, weight and bias (Mamba2's conv with bias, silu);
    with documents, each document convolved alone (its window starts empty)."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen, requires_grad=True)
               for s in ((2, 37, 6), (6, 4), (6,)))
    ours = causal_conv1d(x, w, b, "silu")
    ref = qwen3_next.causal_conv1d_fn(x.transpose(1, 2), w, b, activation="silu")
    ref = ref.transpose(1, 2)
    close(ours, ref)
    dout = torch.randn(ours.shape, generator=gen)
    for a, r in zip(torch.autograd.grad(ours, (x, w, b), dout),
                    torch.autograd.grad(ref, (x, w, b), dout)):
        close(a, r)
    docs = causal_conv1d(x, w, b, "silu", seq_idx=SEQ_IDX)
    for s, ids in enumerate(SEQ_IDX):
        alone = [qwen3_next.causal_conv1d_fn(x[s:s + 1, ids == d].transpose(1, 2), w, b,
                                             activation="silu").transpose(1, 2)
                 for d in ids.unique()]
        close(docs[s:s + 1], torch.cat(alone, dim=1))


# --- Kimi Delta Attention: a decay per key channel ----------------------------------------

def _kda_inputs(T=37, Hk=3, Hv=3, Dk=8, Dv=6, gate=1.0, seed=0):
    """gate scales the log-decay: at 8 a chunk's cumulative decay passes -88, where
    exp(-gc) overflows fp32 (a factorisation over the whole chunk would give inf/nan)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(2, T, Hk, Dk), k=r(2, T, Hk, Dk), v=r(2, T, Hv, Dv),
                g=-gate * F.softplus(r(2, T, Hv, Dk)), beta=torch.rand(2, T, Hv, generator=gen),
                initial_state=r(2, Hv, Dk, Dv))


def _kimi(fn, t, groups=1, **kw):
    """transformers' KDA references take query, key, value and no grouped heads: q and k
    repeated per value head (their gradients then sum over the group, as ours)."""
    q, k = (t[n].repeat_interleave(groups, dim=2) for n in ("q", "k"))
    return fn(q, k, t["v"], g=t["g"], beta=t["beta"], initial_state=t["initial_state"],
              output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)


@pytest.mark.quick
@pytest.mark.parametrize("heads, gate, chunk", [((3, 3), 1.0, 8), ((3, 3), 8.0, 32),
                                                 ((2, 4), 1.0, 16)],
                         ids=["mha", "strong-gates-two-sub-chunks", "grouped"])
def test_chunked_kda_matches_kimi_linear_chunk_and_recurrent(heads, gate, chunk):
    """37 tokens (the last chunk padded), l2-normalised q and k, an initial state: output,
    final state and the gradients of q, k, v, g, beta and the initial state against
    transformers' chunk_kimi_delta_attention (same chunk) and
    recurrent_kimi_delta_attention; strong gates over two sub-chunks of 16 stay finite."""
    Hk, Hv = heads
    ours = _leaves(_kda_inputs(Hk=Hk, Hv=Hv, gate=gate))
    o, f = chunk_kda(**ours, chunk_size=chunk, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(f).all()
    if gate > 1:  # exp(-gc) over the first chunk would overflow fp32 (exp(88.7) = inf)
        assert ours["g"][:, :chunk].sum(1).min() < -88.8
    mine = _grads(o, f, ours)
    for fn, kw in ((kimi_linear.chunk_kimi_delta_attention, dict(chunk_size=chunk)),
                   (kimi_linear.recurrent_kimi_delta_attention, {})):
        ref = _leaves(_kda_inputs(Hk=Hk, Hv=Hv, gate=gate))
        ro, rf = _kimi(fn, ref, Hv // Hk, **kw)
        close(o, ro)
        close(f, rf)
        for a, b in zip(mine, _grads(ro, rf, ref)):
            close(a, b)


def test_kda_documents_restart_the_state_and_the_step_decodes_it():
    """With seq_idx each document is run as if alone (transformers' recurrent reference,
    the first from the initial state); chunk sizes 5, 8, 64 change only rounding; kda_step
    token by token reaches the chunked output and final state (decoding)."""
    inputs = _kda_inputs(Hk=2, Hv=4)
    runs = [chunk_kda(**inputs, chunk_size=c, output_final_state=True, seq_idx=SEQ_IDX,
                      use_qk_l2norm_in_kernel=True) for c in (8, 5, 64)]
    ref = {**inputs, **{n: inputs[n].repeat_interleave(2, dim=2) for n in ("q", "k")}}
    ro, rf = _by_document(_hf_gdn(kimi_linear.recurrent_kimi_delta_attention), ref, SEQ_IDX,
                          "initial_state", output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    for o, f in runs:
        close(o, ro)
        close(f, rf)
    o, f = chunk_kda(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    S, steps = inputs["initial_state"], []
    for t in range(o.shape[1]):
        y, S = kda_step(*(inputs[n][:, t] for n in ("q", "k", "v", "g", "beta")), S,
                        use_qk_l2norm_in_kernel=True)
        steps.append(y)
    close(torch.stack(steps, dim=1), o)
    close(S, f)
