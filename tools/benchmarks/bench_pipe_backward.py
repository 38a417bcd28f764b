"""A pipeline stage's backward with its carried outputs joined (models/pipe_backward.py)
against DeepSpeed's backward per output: step seconds and the first stage's passes.

    python -m tools.benchmarks.bench_pipe_backward --steps 6 --seq 2048

configs/tiny_cpu.yaml's model with experts in every layer (the routers' statistics travel
beside x, so DeepSpeed's engine runs one backward per floating output of a stage), pp2 x
cp --cp over gloo ranks of one thread, fp32, no recompute; each step --micro micro-batches
of one sequence of --seq tokens. Both arms in the same processes, interleaved step by step
(joined, per output, joined, ...): "per output" puts the engine's behaviour back by
replacing one_backward with the identity. Reported per arm: the median step seconds over
the steps after the first of each arm, the first stage's backward passes per micro-batch
(its embedding's gradient hook, which a pass on zeros fires too), and whether the two
arms' gradients agree (they must: only the order of the sums differs).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ctxpar.testing import run_distributed

MOE = ["model.moe={num_experts: 8, top_k: 2, expert_hidden: 64, score: sigmoid, "
       "score_correction_bias: true, bias_update_rate: 0.0, z_loss_coef: 0.001}"]


def _rank(rank, world, a):
    import deepspeed
    import models.gpt_pipe as gpt_pipe
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.config import deepspeed_config, load_config
    from models.loss import global_token_count
    from models.pipe_backward import one_backward

    cp = world // 2
    cfg = load_config(a.config, overrides=[
        f"model.seq_len={a.seq}", "parallel.pp=2", f"parallel.cp={cp}", "parallel.dp=1",
        "parallel.layout=zigzag", f"train.global_batch_size={a.micro}",
        "train.micro_batch_size=1", "activation_checkpointing.mode=none", *MOE],
        world_size=world)
    st = init_parallel_state(cp=cp, pp=2, order=cfg.parallel.order)
    ds = deepspeed_config(cfg, st.dp_size)
    ds["zero_optimization"] = {"stage": 0}
    model = gpt_pipe.GPTPipe.from_config(cfg, st, ds["gradient_accumulation_steps"])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: same steps
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, cfg.model.vocab_size, (a.micro, a.seq + 1), generator=g)
    pos = sequence_positions(a.seq, st.cp_group, "zigzag")
    micro = [{"tokens": shard_sequence(tokens[m:m + 1, :-1], 1, st.cp_group, "zigzag"),
              "labels": shard_sequence(tokens[m:m + 1, 1:], 1, st.cp_group, "zigzag"),
              "positions": pos} for m in range(a.micro)]
    n_tokens = sum(global_token_count(mb["labels"], st.dp_cp_group) for mb in micro)
    passes = []
    if st.pp_rank == 0:
        next(model.parameters()).register_hook(lambda grad: passes.append(1))
    arms = {"joined": one_backward, "per output": lambda outputs: outputs}
    out = {arm: {"seconds": [], "passes": 0, "grads": None} for arm in arms}
    for step in range(2 * a.steps):
        arm = list(arms)[step % 2]
        gpt_pipe.one_backward = arms[arm]
        passes.clear()
        engine.optimizer.zero_grad()
        t0 = time.perf_counter()
        gpt_pipe.train_step(engine, micro, n_tokens, st)
        out[arm]["seconds"].append(time.perf_counter() - t0)
        out[arm]["passes"] = len(passes) / a.micro
        out[arm]["grads"] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    gpt_pipe.one_backward = one_backward
    same = all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in
               zip(out["joined"]["grads"], out["per output"]["grads"]))
    return {arm: (statistics.median(v["seconds"][1:]), v["passes"]) for arm, v in
            out.items()}, same, st.pp_rank


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches a step")
    ap.add_argument("--steps", type=int, default=6, help="steps per arm")
    a = ap.parse_args(argv)
    results = run_distributed(_rank, 2 * a.cp, a, timeout=3600)
    for arm in ("joined", "per output"):
        seconds = max(r[0][arm][0] for r in results)  # the step ends with the last rank
        passes = next(r[0][arm][1] for r in results if r[2] == 0)
        print(f"{arm:>10}: {seconds:.3f} s a step (median), first stage's backward passes "
              f"per micro-batch {passes:.0f}")
    ratio = max(r[0]["per output"][0] for r in results) / max(r[0]["joined"][0]
                                                              for r in results)
    print(f"per output / joined: {ratio:.2f}x; gradients equal: "
          f"{all(r[1] for r in results)}")


if __name__ == "__main__":
    main()
