"""The planner on DeepSeek-V4's attention (ctxpar/plan/compressed_layers.py): what a layer of
each type ('sliding_attention', CSA, HCA) keeps for backward equals autograd's saved bytes
in every checkpointing mode (one process, fp32, exact: shapes only), plus the CSA core's
selection, held beside autograd on its part and measured here on the object itself; the
parameters equal the model's; the bytes a rank sends in a compressed layer equal
ctxpar.testing.compressed.sent_bytes' count from the layout, rank by rank; the attention
pairs equal a brute-force count; and a V4 config gets a plan and its model line, which
says the 512-wide heads run on the math kernel. Shapes as tests/test_v4_attention.py's.
"""
import weakref
from contextlib import contextmanager

import pytest

from ctxpar.config.compressed_attention import CompressedAttentionConfig
from ctxpar.context_parallel import compressed_sparse
from ctxpar.context_parallel.halo import halo_tokens
from ctxpar.plan import comm_bytes, compressed_layers, counts
from ctxpar.plan.candidate import Candidate
from ctxpar.testing.compressed import sent_bytes
from tests.helpers.saved_bytes import assert_planner_saves_what_autograd_saves
from tests.test_v4_attention import KINDS, SECTION, _load, model_config

CSA, HCA = KINDS[1], KINDS[2]
# every width its own, so that a term counted at the wrong one shows
WIDE = dict(SECTION, q_lora_rank=12, o_lora_rank=6, index_head_dim=10)


class Alive(list):
    """Weak references to selections; iterates the bytes of those still alive (a
    checkpointed forward's selection is dropped with its core's context)."""

    def __iter__(self):
        for ref in list.__iter__(self):
            sel = ref()
            if sel is not None:
                yield sum(t.untyped_storage().nbytes()
                          for t in (sel.rows, sel.counts, sel.starts))


@contextmanager
def selections(monkeypatch):
    """The EntrySelections made meanwhile (rows, counts, starts: what the core holds)."""
    held, init = Alive(), compressed_sparse.EntrySelection.__init__

    def record(self, *args):
        init(self, *args)
        held.append(weakref.ref(self))
    monkeypatch.setattr(compressed_sparse.EntrySelection, "__init__", record)
    yield held


@pytest.mark.quick
def test_v4_layers_save_what_autograd_saves_in_every_mode(monkeypatch):
    """The three types in one model (two RoPE bases), then each alone (every_n_layers:
    layers 0 and 2 replayed), every mode."""
    for kinds in (list(KINDS), [CSA], [HCA], ["sliding_attention"]):
        m = model_config(kinds, seq_len=32, compressed_attention=CompressedAttentionConfig(
            **WIDE))
        assert_planner_saves_what_autograd_saves(
            m, msg=kinds, beside=lambda: selections(monkeypatch))


def test_v4_parameters_equal_the_models():
    from models.gpt import GPT
    from models.options import ModelOptions
    m = model_config(list(KINDS), seq_len=32, compressed_attention=CompressedAttentionConfig(
        **WIDE))
    model = GPT(m, options=ModelOptions(seed=1))
    assert counts.total_params(m) == sum(p.numel() for p in model.parameters())


def test_the_compressed_layers_bytes_are_sent_bytes_rank_by_rank():
    """The window's halo (comm_bytes.masked_cp_bytes at one K = V head) plus the compressors'
    gather and halo (compressed_layers.compressor_wire) equal the layout's rule; the
    layer's count is its busiest rank's."""
    for T, P, layout in ((32, 2, "zigzag"), (64, 4, "zigzag"), (96, 3, "contiguous"),
                         (40, 2, "contiguous")):  # the last: ranks end 2 and 3 windows
        for kind in (CSA, HCA):
            m = model_config([kind], seq_len=T)
            cand = Candidate(1, P, 1, 1, "ring", 1, layout, micro_batch=2,
                             ring_grad_dtype="fp32")
            rate, csa, S = m.compressed_attention.rate(kind), kind == CSA, T // P
            widths = [m.head_dim] + ([m.compressed_attention.index_head_dim] if csa else [])
            ranks = []
            for r in range(P):
                window = halo_tokens(layout, r, P, S, sliding_window=m.sliding_window)
                want = sent_bytes(P, layout, S, r, rate, csa, window, 2, widths, 4)
                win = comm_bytes.masked_cp_bytes("ring", P, 1, 2, S, m.n_heads, 1, m.head_dim, 4,
                                             4, layout, m.sliding_window, rank=r)
                comp = compressed_layers.compressor_wire(m, cand, kind, 2, 4, r)
                assert (win[0] + comp[0], win[1] + comp[1]) == tuple(want), (T, P, kind, r)
                ranks.append(tuple(want))
            attn = next(a for a in _attention(m) if a.kind == kind)
            assert comm_bytes.layer_cp_bytes(m, cand, 4, attn) == max(ranks, key=sum)


def _attention(m):
    from ctxpar.config.layers import layer_attention
    return layer_attention(m)


def test_the_attention_pairs_are_a_brute_force_count():
    """Each query's window keys, then HCA's complete entries or CSA's top-k of them, and
    the indexer's every complete entry, on the busiest rank."""
    for P, layout in ((1, "zigzag"), (2, "zigzag"), (4, "contiguous")):
        for kind in KINDS:
            m = model_config([kind], seq_len=64)
            cand = Candidate(1, P, 1, 1, "ring", 1, layout, micro_batch=2)
            ca, w = m.compressed_attention, m.sliding_window
            best = (0, 0)
            for r in range(P):
                pairs = index = 0
                for lo, hi in compressed_layers.rank_spans(64, P, layout, r):
                    for t in range(lo, hi):
                        pairs += min(w, t + 1)
                        if kind != "sliding_attention":
                            seen = (t + 1) // ca.rate(kind)
                            pairs += min(seen, ca.index_topk) if kind == CSA else seen
                            index += seen if kind == CSA else 0
                best = max(best, (pairs, index))
            assert compressed_layers.layer_pairs(m, cand, kind) == best, (P, kind)


def test_a_v4_model_is_planned_and_its_heads_are_said_to_run_on_the_math_kernel():
    from ctxpar.plan.cluster import GPUS, Cluster
    from ctxpar.plan.search import search
    cfg = _load(model=dict(head_dim=512, partial_rotary_factor=1 / 64, seq_len=4096,
                           compressed_attention={**SECTION, "index_head_dim": 64}))
    plans = search(cfg, Cluster(1, 4, GPUS["h100"]))
    assert plans and all(p.candidate.cp_comm in ("ring", "allgather") for p in plans)
    line = compressed_layers.model_line(cfg, plans[0], 2)
    assert "head dim 512: flash_attn, sdpa (CUDA bf16/fp16)" in line
    assert "math kernel" in line and "\n" not in line
