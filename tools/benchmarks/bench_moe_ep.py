"""Expert parallelism folded over DP x CP: tokens/s of a small MoE GPT at ep = 1 and ep > 1.

    python -m tools.benchmarks.bench_moe_ep --worlds 2 4 --seq-len 4096 --steps 4

Each side runs --steps timed optimizer steps (after one warmup) of the same model on the
same data: a sample of --seq-len tokens per DP rank, split over cp = 2 ranks (zigzag), one
gloo rank per process and one thread each. A step is the forward and backward (token loss
plus the routers' load-balancing and z losses), the gradients reduced as train.py's
DeepSpeed engine reduces them (every gradient summed over DP x CP in one flat buffer, the
experts' over their expert-data-parallel group instead: ctxpar/distributed/
expert_parallel.py) and an AdamW step. Sides, on each world size (dp = world / 2):

    ep1   every rank holds all E experts (no all-to-all)
    ep2   E/2 experts a rank; tokens to their experts and back by all-to-all
    ep4   (world 4) E/4 experts a rank, over both sequences' ranks

Per side: tokens/s (the step's tokens over rank 0's wall clock between barriers), the
share of the step spent inside the dispatch's all-to-alls (the counts' exchange and the
rows' both ways, forward and backward, timed around each call on rank 0), the bytes rank 0
sent to other ranks' experts (moe_stats, forward), and each rank's parameter bytes (the
experts' shrink by ep). --json keeps the rows.
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from ctxpar.testing import run_distributed, save_results


def _model_cfg(a):
    from ctxpar.config import ModelConfig
    from ctxpar.config.moe import MoEConfig
    return ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_heads=8, n_kv_heads=4,
                       n_layers=a.layers, seq_len=a.seq_len, ffn_hidden=4 * a.d_model,
                       moe=MoEConfig(num_experts=a.experts, top_k=a.top_k,
                                     expert_hidden=a.expert_hidden, aux_loss_coef=0.01,
                                     z_loss_coef=0.001))


class _TimedDist:
    """torch.distributed as ctxpar/moe/dispatch.py sees it, its all_to_all_single timed."""

    def __init__(self, dist):
        self._dist, self.seconds = dist, 0.0

    def all_to_all_single(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._dist.all_to_all_single(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self._dist, name)


def _reduce(model, state, dp: int) -> None:
    """train.py's reduction: one flat all-reduce per group, then / dp (models/loss.py)."""
    import torch
    import torch.distributed as dist
    for expert in (False, True):
        grads = [p.grad for p in model.parameters()
                 if (getattr(p, "expert_shard", None) is not None) == expert
                 and p.grad is not None]
        if not grads:
            continue
        group = state.edp_group if expert and state.ep_size > 1 else state.dp_cp_group
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(dp)
        for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(new)


def _rank(rank, world, a):
    import torch
    import torch.distributed as dist

    import ctxpar.moe.dispatch as dispatch
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.moe import moe_stats, reset_moe_stats
    from models.gpt import GPT
    from models.loss import global_token_count, loss_for_backward
    from models.options import ModelGroups, ModelOptions

    timed = _TimedDist(dist)
    dispatch.dist = timed
    cfg, rows = _model_cfg(a), []
    for ep in a.eps:
        if (world % ep) or ep > world:
            continue
        state = init_parallel_state(cp=2, dp=world // 2, ep=ep)
        model = GPT(cfg, ModelGroups.from_state(state), ModelOptions(layout="zigzag", seed=1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        dp, times, shares = state.dp_size, [], []
        for s in range(a.steps + 1):
            g = torch.Generator().manual_seed(1000 * s + state.dp_rank)
            tokens = torch.randint(0, a.vocab, (1, a.seq_len), generator=g)
            labels = torch.roll(tokens, -1, 1)
            tok, lab = (shard_sequence(t, 1, state.cp_group, "zigzag") for t in (tokens, labels))
            pos = sequence_positions(a.seq_len, state.cp_group, "zigzag")
            dist.barrier()
            timed.seconds, t0 = 0.0, time.perf_counter()
            reset_moe_stats()
            n = global_token_count(lab, state.dp_cp_group)
            loss = model(tok, pos, lab)
            (loss_for_backward(loss, n, dp) + model.router_losses.share * dp).backward()
            _reduce(model, state, dp)
            opt.step()
            opt.zero_grad(set_to_none=False)
            dist.barrier()
            if s > 0:  # step 0 warms up
                times.append(time.perf_counter() - t0)
                shares.append(timed.seconds / times[-1])
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append(dict(world=world, ep=ep, seconds=times, dispatch_share=shares,
                         bytes_sent=moe_stats()["bytes_sent"], param_bytes=param_bytes))
        del model, opt
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sample (per DP rank)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--json", default="runs/bench/moe_ep.json")
    a = ap.parse_args(argv)
    rows = []
    for world in a.worlds:
        for r in run_distributed(_rank, world, a, timeout=3600)[0]:
            r = SimpleNamespace(**r)
            step = sorted(r.seconds)[len(r.seconds) // 2]  # the median step
            share = sorted(r.dispatch_share)[len(r.dispatch_share) // 2]
            tokens_per_s = world // 2 * a.seq_len / step
            rows.append(dict(vars(r), median_step_s=step, tokens_per_s=tokens_per_s,
                             median_dispatch_share=share))
            print(f"world {world} cp2 x dp{world // 2} ep{r.ep}: {tokens_per_s:>8,.0f} tokens/s "
                  f"(median step {step * 1e3:.0f} ms), all-to-all {share:.1%} of the step, "
                  f"{r.bytes_sent:,} bytes sent (rank 0, forward), "
                  f"{r.param_bytes / 2**20:.1f} MiB of parameters a rank", flush=True)
    save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
