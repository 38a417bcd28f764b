"""The planner's held terms of Gemma 4 (ctxpar/plan/kv_held.py) against two cp2 gloo ranks.

- the bytes the attention modules keep after a step (a shared-KV producer's shared_kv and
  held_kv, the k_eq_v layers' sequence_rotary; storages counted once) equal the plan's
  'shared K/V (held)' + 'sequence cos/sin (k_eq_v)' of its later phases, exactly, under
  the all-gather (its slots: P x the local K/V), Ulysses (regrouped by heads) and the
  ring, keys equal to values or not, modes none and full;
- at the end of the forward, what is live of it beside autograd's saved tensors (the
  union of the two, storages once): the all-gather's above the ring's by the plan's
  forward 'shared K/V (held)' difference, the slots, mode none (the core saves their views
  in place of the local K/V) and full (saved nowhere), exactly; under full what the
  modules keep beyond the saved tensors is the plan's forward terms (local K/V, slots or
  regrouping, cos/sin), exactly.
One spawn of two ranks, the cases looped inside. The terms are absolute bytes: a step's
rise above its start (allocator_peaks) has the previous step's held tensors in its start
(docs/planner.md, Gemma 4).
"""
import pickle
from dataclasses import replace

import pytest
import torch

from ctxpar.testing import run_distributed
from test_gemma4 import GEMMA4

# the full producer's K/V (4 kv heads of 128) the largest tensor of a layer; (k_eq_v,
# shared layers, cp_comm, mode, tokens)
WIDE = dict(vocab_size=1024, global_head_dim=128, global_n_kv_heads=4, ffn_hidden=128)
HELD_CASES = [(False, 2, "allgather", "none", 256), (True, 2, "allgather", "full", 256),
              (False, 2, "ulysses", "none", 256), (True, 2, "ulysses", "full", 256),
              (False, 2, "ring", "full", 256), (True, 0, "ring", "none", 256)]
# (all-gather, ring) pairs whose live bytes at the end of the forward are compared
FORWARD_PAIRS = [((False, 2, "allgather", "none", 256), (False, 2, "ring", "none", 256)),
                 ((True, 2, "allgather", "full", 256), (True, 2, "ring", "full", 256))]
CASES = HELD_CASES + [pair[1] for pair in FORWARD_PAIRS if pair[1] not in HELD_CASES]


def _model(k_eq_v, shared, tokens):
    return replace(GEMMA4, attention_k_eq_v=k_eq_v, num_kv_shared_layers=shared,
                   seq_len=tokens, **WIDE)


def _held_storages(model) -> dict:
    """{storage pointer: bytes} of the tensors the attention modules keep."""
    from torch.utils._pytree import tree_flatten
    kept = [getattr(layer.mixer, name, None) for layer in model.layers
            for name in ("shared_kv", "held_kv", "sequence_rotary")]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tree_flatten(kept)[0] if isinstance(t, torch.Tensor)}


def _rank(rank, world, payload):
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.testing.memory import saved_tensor_bytes
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions
    st = init_parallel_state(cp=2, dp=1)
    out = {}
    for k_eq_v, shared, comm, mode, n in pickle.loads(payload):
        tokens = torch.randint(0, WIDE["vocab_size"], (1, n),
                               generator=torch.Generator().manual_seed(0))
        tok = shard_sequence(tokens, 1, st.cp_group, "zigzag")
        pos = sequence_positions(n, st.cp_group, "zigzag")
        model = GPT(_model(k_eq_v, shared, n), ModelGroups.from_state(st),
                    ModelOptions(layout="zigzag", cp_comm=comm, seed=1,
                                 activation_checkpointing=mode))
        case = (k_eq_v, shared, comm, mode, n)
        with saved_tensor_bytes(model.parameters()) as seen:
            loss = model(tok, pos, tok)
        kept = _held_storages(model)
        out["forward", *case] = sum({**seen, **kept}.values())
        out["beyond saved", *case] = sum(b for ptr, b in kept.items() if ptr not in seen)
        loss.backward()
        out["held", *case] = sum(_held_storages(model).values())
    return out


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_rank, 2, pickle.dumps(CASES), timeout=240)


def _phases(k_eq_v, shared, comm, mode, tokens):
    from ctxpar.config import Config
    from ctxpar.plan.candidate import Candidate
    from ctxpar.plan.memory import stage_memory
    from ctxpar.plan.zero_state import zero_config
    c = Config()
    c.model, c.activation_checkpointing.mode = _model(k_eq_v, shared, tokens), mode
    cand = Candidate(1, 2, 1, 1, comm, 2 if comm == "ulysses" else 1, "zigzag", zero=0,
                     activation=mode)
    return stage_memory(c, cand, False, 1, 0, "cpu", zero_config({})).phases


@pytest.mark.parametrize("case", HELD_CASES)
def test_the_bytes_the_attention_modules_keep_are_the_plans_held_terms(cp2, case):
    step = next(p for p in _phases(*case) if p.name == "optimizer step").terms
    want = step.get("shared K/V (held)", 0) + step.get("sequence cos/sin (k_eq_v)", 0)
    for rank, got in enumerate(cp2):
        assert got[("held", *case)] == want, (rank, case)



@pytest.mark.quick
def test_held_terms_are_one_rotary_pair_per_rope_and_none_without_cp_or_with_a_pipeline():
    """No process: Gemma 4 31B's ten full layers share one whole-sequence (cos, sin) (T x
    512 channels x 4 bytes); at cp 1, or with a pipeline (its stages carry K and V), or
    for a model without shared K/V or k_eq_v, nothing is held."""
    from ctxpar.config import ModelConfig, load_config
    from ctxpar.plan.candidate import Candidate
    from ctxpar.plan.kv_held import sequence_rotary_held, shared_kv_held
    m = load_config("configs/extend_gemma4_31b_512k.yaml", [], world_size=64,
                    check_paths=False).model
    assert sequence_rotary_held(m, Candidate(2, 32, 1, 1), 1, False) == m.seq_len * 512 * 4
    assert sequence_rotary_held(m, Candidate(2, 1, 1, 32), 1, False) == 0
    assert sequence_rotary_held(m, Candidate(2, 16, 2, 1), 1, False) == 0
    shared = _model(False, 2, 256)
    assert shared_kv_held(shared, Candidate(1, 2, 1, 1, "allgather"), 128, 4, 0, 5)["after"] > 0
    assert shared_kv_held(shared, Candidate(1, 2, 2, 1, "allgather"), 128, 4, 0, 3) == \
        {"during": 0.0, "after": 0.0}
    plain = ModelConfig(vocab_size=64, seq_len=32, n_layers=2, d_model=32, n_heads=4)
    assert shared_kv_held(plain, Candidate(1, 2, 1, 1, "allgather"), 16, 4, 0, 2)["after"] == 0
    assert sequence_rotary_held(plain, Candidate(1, 2, 1, 1), 1, False) == 0


@pytest.mark.parametrize("pair", FORWARD_PAIRS)
def test_the_all_gathers_slots_are_live_beside_the_saved_tensors_as_planned(cp2, pair):
    def planned(case):
        forward = next(p for p in _phases(*case) if p.name.startswith("forward")).terms
        return forward.get("shared K/V (held)", 0)
    want = planned(pair[0]) - planned(pair[1])
    assert want > 0
    for rank, got in enumerate(cp2):
        assert got[("forward", *pair[0])] - got[("forward", *pair[1])] == want, (rank, pair)


@pytest.mark.parametrize("case", [c for c in CASES if c[3] == "full"])
def test_under_full_recompute_the_modules_keep_the_plans_forward_terms_beyond_the_saved(
        cp2, case):
    forward = next(p for p in _phases(*case) if p.name.startswith("forward")).terms
    want = forward.get("shared K/V (held)", 0) + forward.get("sequence cos/sin (k_eq_v)", 0)
    for rank, got in enumerate(cp2):
        assert got[("beyond saved", *case)] == want, (rank, case)
