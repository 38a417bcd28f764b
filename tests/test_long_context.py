"""Long-context evaluation: the tasks (ctxpar/data/long_context.py) and their answers by
CP generation (ctxpar/components/long_context.py), the same at cp 1, 2 and 3, and on a
mixture of experts' checkpoint at cp2 x ep2."""
import pickle

import pytest
import torch

from ctxpar.components.long_context import (loss_by_position, position_buckets, run_tasks,
                                            task_grid)
from ctxpar.data import DataError, load_tokenizer
from ctxpar.data.long_context import TASKS, Haystack, make_task
from ctxpar.testing import run_distributed

TOK = load_tokenizer(None)  # byte-level: a character is a token


@pytest.mark.quick
@pytest.mark.parametrize("name", TASKS)
def test_tasks_are_exactly_long_hold_their_answers_and_repeat(name):
    hay = Haystack.filler(TOK, seed=1)
    t = make_task(name, TOK, hay, length=400, depth=0.3, seed=7, n=3)
    assert len(t.prompt) == 400 and t == make_task(name, TOK, hay, 400, 0.3, 7, 3)
    text = TOK.decode(t.prompt)
    for a in t.answers:  # every answer is in the haystack's needles, none by accident
        assert a in text
    assert t.score(" ".join(t.answers)) == 1.0 and t.score("") == 0.0
    assert make_task(name, TOK, hay, 400, 0.3, 8, 3).prompt != t.prompt  # the seed matters


def test_the_needle_sits_at_its_depth_at_a_sentence_start():
    hay = Haystack.filler(TOK, seed=0)
    for depth in (0.0, 0.5, 1.0):
        t = make_task("needle", TOK, hay, length=1000, depth=depth, seed=2)
        text = TOK.decode(t.prompt)
        at = text.index("The pass key is")
        assert abs(at - depth * (1000 - 80)) < 40, (depth, at)  # within one sentence
        assert at == 0 or text[at - 2:at] == ". " or depth == 1.0  # 1: before the question
    assert text.endswith("Remember it. What is the pass key? The pass key is ")
    held = Haystack.tokens(TOK, list(range(60, 120)) * 20)  # held-out ids: any token
    assert len(make_task("needle", TOK, held, 500, 0.5, 0).prompt) == 500


@pytest.mark.parametrize("kw,msg", [
    (dict(length=50), "task 'needle' needs more than length=50 tokens"),
    (dict(depth=1.5), "depth=1.5 must be in [0, 1]"),
    (dict(name="haystack"), "unknown task 'haystack'"),
])
def test_bad_tasks_are_refused_in_one_line(kw, msg):
    args = dict(name="needle", length=300, depth=0.5)
    args.update(kw)
    with pytest.raises(DataError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        make_task(args.pop("name"), TOK, Haystack.filler(TOK), **args)


def test_position_buckets_are_log2_spans():
    assert position_buckets(10) == [(0, 0), (1, 2), (3, 6), (7, 9)]


# A hybrid (Gated DeltaNet, Mamba2, attention): its linear layers by state passing, the
# prefill leaving every CP rank the final recurrent and conv states for decoding.
HYBRID = dict(n_layers=3, layer_types=["linear_attention", "mamba", "full_attention"],
              linear_num_key_heads=2, linear_key_head_dim=16, mamba_head_dim=16,
              ssm_state_size=16, n_groups=2, linear_chunk_size=16)


def _answers(rank, world, payload):
    from ctxpar import init_parallel_state
    from ctxpar.config import ModelConfig
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions

    grid, hybrid = payload
    torch.manual_seed(0)
    inputs = torch.randint(0, 256, (3, 96))
    out = {}
    # state passing runs on contiguous and zigzag layouts (the hybrid's cp 3 contiguous)
    for cp, layout in ((1, "contiguous"), (2, "zigzag"),
                       (3, "contiguous" if hybrid else "striped")):
        st = init_parallel_state(tp=1, cp=cp)  # dp = 6 / cp replicas
        # init_std 0.2 spreads a random model's logits: greedy is far from ties.
        cfg = ModelConfig(**{**dict(vocab_size=256, seq_len=256, n_layers=2, d_model=32,
                                    n_heads=4, n_kv_heads=2, init_std=0.2),
                             **(HYBRID if hybrid else {})})
        model = GPT(cfg, ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group),
                    ModelOptions(layout=layout, seed=3)).eval()
        groups = dict(layout=layout, cp_group=st.cp_group, tp_group=st.tp_group)
        cells = run_tasks(model, TOK, grid, **groups)
        out[cp] = ([c.completions for c in cells], [c.score for c in cells],
                   loss_by_position(model, inputs, **groups))
    return pickle.dumps(out)


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_answers_and_loss_by_position_are_the_same_at_cp_1_2_3(hybrid):
    grid = task_grid(TOK, ["needle", "multikey", "variable_tracking"], [120, 201], [0.0, 1.0],
                     samples=2, n=2)
    for rank, got in enumerate(run_distributed(_answers, 6, (grid, hybrid), timeout=300)):
        got = pickle.loads(got)
        texts, scores, buckets = got[1]
        assert len(texts) == 12 and all(len(t) == 2 for t in texts)
        # 3 samples x positions 0..94 (the last token has no next one) in log2 buckets
        assert [b.tokens for b in buckets] == [3, 6, 12, 24, 48, 96, 96]
        for cp in (2, 3):
            assert got[cp][0] == texts and got[cp][1] == scores, (rank, cp)
            # cp 3 scores the first 96 - 96 % 3 = 96 tokens too; fp32 sums in another order.
            for a, b in zip(got[cp][2], buckets):
                assert (a.first, a.last, a.tokens) == (b.first, b.last, b.tokens)
                assert abs(a.loss - b.loss) <= 1e-5 * b.loss, (rank, cp, a, b)


def _moe_answers(rank, world, payload):
    """A mixture of experts' checkpoint (a module file, every expert whole) loaded at cp 1
    and at cp2 x ep2 (each rank its 2 of the 4 experts, the rows all-to-all'd over the CP
    ranks in prefill and decode): each layout's completions, scores and loss by position."""
    import torch.distributed as dist
    from ctxpar import init_parallel_state
    from ctxpar.config import ModelConfig
    from ctxpar.config.moe import MoEConfig
    from ctxpar.inference.checkpoint import CheckpointFiles, load_weights_
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions

    grid, folder = payload
    cfg = ModelConfig(vocab_size=256, seq_len=256, n_layers=2, d_model=32, n_heads=4,
                      n_kv_heads=2, init_std=0.2, moe=MoEConfig(num_experts=4, top_k=2,
                                                                expert_hidden=32, layers=[1]))
    torch.manual_seed(0)
    inputs = torch.randint(0, 256, (3, 96))
    files, out = CheckpointFiles(folder, "module", tp=1), {}
    for cp, layout in ((1, "contiguous"), (2, "zigzag")):
        st = init_parallel_state(tp=1, cp=cp, ep=cp)  # dp = 2 / cp replicas
        if cp == 1 and rank == 0:  # the checkpoint: seed 3's weights, all 4 experts
            saved = GPT(cfg, ModelGroups.from_state(st), ModelOptions(layout=layout, seed=3))
            torch.save({"module": saved.state_dict()}, f"{folder}/mp_rank_00_model_states.pt")
        dist.barrier()
        model = GPT(cfg, ModelGroups.from_state(st), ModelOptions(layout=layout, seed=5)).eval()
        load_weights_(model, files, st.tp_group)  # not seed 5's: the checkpoint's
        groups = dict(layout=layout, cp_group=st.cp_group, tp_group=st.tp_group)
        cells = run_tasks(model, TOK, grid, **groups)
        out[cp] = (model.layers[1].mlp.experts.gate_up_proj.shape[0],
                   [c.completions for c in cells], loss_by_position(model, inputs, **groups))
    return pickle.dumps(out)


def test_a_moe_checkpoint_answers_alike_at_cp1_and_cp2_ep2(tmp_path):
    """tools/long_context_eval's model (models/inference.py: start_model at parallel.ep) on
    a mixture of experts: the same answers and loss by position at cp2 x ep2 as at cp 1,
    from the same checkpoint."""
    grid = task_grid(TOK, ["needle", "multikey"], [120], [0.0, 1.0], samples=2, n=2)
    for rank, got in enumerate(run_distributed(_moe_answers, 2, (grid, str(tmp_path)),
                                               timeout=300)):
        got = pickle.loads(got)
        (local1, texts, buckets), (local2, texts2, buckets2) = got[1], got[2]
        assert (local1, local2) == (4, 2) and len(texts) == 4
        assert texts2 == texts, rank
        assert [b.tokens for b in buckets] == [3, 6, 12, 24, 48, 96, 96]
        for a, b in zip(buckets2, buckets):  # fp32 sums in another order
            assert (a.first, a.last, a.tokens) == (b.first, b.last, b.tokens)
            assert abs(a.loss - b.loss) <= 1e-5 * b.loss, (rank, a, b)


@pytest.mark.quick
def test_the_evaluation_grid_runs_experts_at_ep_1_unless_asked():
    """A run trained at cp2 x ep2 evaluates on one rank (its ep need not fit the grid,
    which refused it before); --set parallel.ep=2 splits the experts over 2 CP ranks."""
    from ctxpar.config import config_from_dict
    from models.inference import layout_overrides
    run = {"model": {"seq_len": 256, "moe": {"num_experts": 4, "top_k": 2}},
           "parallel": {"cp": 2, "dp": 1, "ep": 2},
           "deepspeed": {"zero_optimization": {"stage": 1}}}
    for world, sets, ep in ((1, [], 1), (2, [], 1), (2, ["parallel.ep=2"], 2)):
        cfg = config_from_dict(run, overrides=layout_overrides(sets, world),
                               world_size=world, training=False)
        assert (cfg.parallel.cp, cfg.parallel.ep) == (world, ep)


def test_loss_samples_from_documents_start_at_document_starts(tmp_path):
    # The loss by position's samples: the first `length` tokens of held-out documents that
    # long, in file order, never a window's arbitrary offset and never past the stretch.
    from ctxpar.data import IndexedDatasetWriter, TokenWindows
    lengths = [30, 5, 40, 12, 50, 25]
    with IndexedDatasetWriter(str(tmp_path / "c"), vocab_size=256, eos_id=0) as w:
        for i, n in enumerate(lengths):
            w.add_document([i + 1] * (n - 1))  # + EOS: n tokens
    src = TokenWindows(str(tmp_path / "c"), seq_len=10, split="eval", first=3, count=12)
    docs = src.document_starts(20, n=8)  # starts >= 30: documents 1.. of 20+ tokens
    assert docs.shape == (2, 20) and docs[:, 0].tolist() == [3, 5]
    assert (docs[0, :-1] == 3).all() and docs.tolist()[1] == [5] * 20
    assert src.document_starts(20, n=1).shape == (1, 20)
    assert src.document_starts(60, n=8).shape == (0, 60)


@pytest.mark.quick
def test_fewer_held_out_samples_than_asked_are_used_once_and_warned(tmp_path, capsys,
                                                                   monkeypatch):
    """--loss-samples 4 where the held-out split holds one document of model.seq_len tokens
    (documents) or 2 windows (windows): those, each once, and one warning line naming
    both counts, not 1 sample in silence or windows repeated."""
    from ctxpar.config import config_from_dict
    from ctxpar.data import IndexedDatasetWriter
    from tools.long_context_eval import heldout
    monkeypatch.setenv("RANK", "0")  # warn() speaks on rank 0
    prefix = str(tmp_path / "c")
    with IndexedDatasetWriter(prefix, vocab_size=256, eos_id=0) as w:
        for _ in range(18):
            w.add_document([5] * 40)  # short: no position past 40 in a document
        w.add_document(list(range(1, 101)))  # the one held-out document of 64 tokens
    cfg = config_from_dict({"model": {"seq_len": 64}, "data": {
        "kind": "tokens", "path": prefix, "eval_fraction": 0.25}})
    inputs, kind = heldout(cfg, 4)
    assert kind == "documents" and inputs.shape == (1, 64)
    assert inputs[0].tolist() == list(range(1, 65))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--loss-samples 4: the held-out split holds 1 document of at " \
        "least model.seq_len=64 tokens: the loss by position is over those 1" in err[0], err
    inputs, kind = heldout(cfg, 4, "windows")
    windows = inputs.shape[0]
    assert kind == "windows" and 1 <= windows < 4
    assert len({tuple(x) for x in inputs.tolist()}) == windows  # none repeated
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"holds {windows} window" in err[0], err
    passkey = config_from_dict({"model": {"seq_len": 128}})
    assert heldout(passkey, 4)[0].shape == (4, 128) and capsys.readouterr().err == ""


@pytest.mark.quick
def test_the_heatmaps_titles_and_trained_length_mark_do_not_overlap():
    """Drawn, the figure's title, each panel's title and every text outside the panels (a
    label for the trained length) take boxes apart from one another."""
    import matplotlib.pyplot as plt
    from ctxpar.components.long_context import Cell, heatmap_figure
    cells = [Cell(t, n, d, 0.5, 1, []) for t in ("needle", "multikey")
             for n in (64, 128, 192, 255) for d in (0.0, 0.5, 1.0)]
    fig = heatmap_figure(cells, "mine step_00000020", trained_length=128)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [fig._suptitle.get_window_extent(renderer)]
    for ax in fig.axes[:2]:
        inside = ax.get_window_extent(renderer)
        boxes.append(ax.title.get_window_extent(renderer))
        boxes += [b for t in ax.texts for b in [t.get_window_extent(renderer)]
                  if not inside.contains(*b.p0) or not inside.contains(*b.p1)]
    assert "128" in fig.axes[0].get_title()  # the dashed line is explained somewhere
    plt.close(fig)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
