"""The rank grid and every process group: TP x CP x PP x DP from one order string.

The grid is built once, the way Megatron's RankGenerator and picotron do it:
``torch.arange(world).view(...)`` with the axes of the order string, the first name
innermost (adjacent global ranks). The default order ``tp-cp-dp-pp`` keeps a TP group
on adjacent GPUs (one NVLink domain), puts the CP ring next, and the pipeline outermost.

Every family of groups (tp, cp, pp, dp and the combined dp x cp) is derived from that
single grid, so the groups of one family partition the world and every rank sits in
exactly one group of each family. The CP axis itself factors into a Ulysses sub-axis
(inner, size u, adjacent ranks) and a ring sub-axis (outer, size cp/u), which give the
'ulysses' and 'ring' families used by hybrid context parallelism; cp rank =
ring_rank * u + ulysses_rank. ``ParallelState`` is a frozen object holding this rank's
view; layers and kernels get it (or an explicit ``group=``) passed to them. The one
accessor for the current state is ``get_parallel_state()``, for train.py.
"""
from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist

AXES = ("tp", "cp", "pp", "dp")
CP_SUBAXES = ("ulysses", "ring")  # the cp axis, innermost first
DEFAULT_ORDER = "tp-cp-dp-pp"


def parse_order(order: str) -> List[str]:
    """'tp-cp-dp-pp' -> ['tp', 'cp', 'dp', 'pp'], checking each axis appears exactly once."""
    names = [n.strip() for n in str(order).lower().split("-")]
    if sorted(names) != sorted(AXES):
        raise ValueError(
            f"parallel.order={order!r} must name each of tp, cp, pp, dp exactly once "
            f"separated by '-', e.g. {DEFAULT_ORDER!r}"
        )
    return names


def resolve_sizes(world_size: int, tp: int = 1, cp: int = 1, pp: int = 1,
                  dp: Union[int, str] = "auto") -> Dict[str, int]:
    """Check the degrees against the world size; dp='auto' takes what is left."""
    for name, size in (("tp", tp), ("cp", cp), ("pp", pp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"parallel size {name}={size!r} must be an integer >= 1")
    model = tp * cp * pp
    if dp == "auto":
        if world_size % model != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp*cp*pp = "
                f"{tp}*{cp}*{pp} = {model}, so dp cannot be derived"
            )
        dp = world_size // model
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"parallel size dp={dp!r} must be an integer >= 1 or 'auto'")
    if model * dp != world_size:
        raise ValueError(
            f"parallel.tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {model * dp} does not equal "
            f"the world size {world_size}"
        )
    return {"tp": tp, "cp": cp, "pp": pp, "dp": dp}


def check_ulysses(cp: int, ulysses: int) -> None:
    """The Ulysses degree must be a positive divisor of cp (ring = cp / ulysses)."""
    if not isinstance(ulysses, int) or isinstance(ulysses, bool) or ulysses < 1 \
            or cp % ulysses:
        raise ValueError(f"parallel.ulysses={ulysses!r} must be an integer >= 1 dividing "
                         f"parallel.cp={cp}")


def rank_grid(world_size: int, tp: int = 1, cp: int = 1, pp: int = 1,
              dp: Union[int, str] = "auto", order: str = DEFAULT_ORDER, ulysses: int = 1,
              ep: int = 1) -> Dict[str, List[List[int]]]:
    """Every group of every family as lists of global ranks; pure, no processes.

    Returns keys 'tp', 'cp', 'pp', 'dp', 'dp_cp' (ranks that differ only along the dp
    and cp axes: the group gradients are reduced over) and the two parts of each CP
    group, 'ulysses' (its `ulysses` adjacent members) and 'ring' (one member of each
    Ulysses group). Each family partitions range(world_size); ranks inside a group are
    ascending along that axis, so cp rank = ring rank * ulysses + ulysses rank.

    Expert parallelism folds over DP x CP (Megatron's MoE parallel folding): 'ep' cuts each
    dp_cp group into runs of `ep` consecutive members (CP's ranks first, the innermost),
    'edp' takes one member of each run (the ranks holding the same experts: the experts'
    gradients are reduced over it).
    """
    names = parse_order(order)
    sizes = resolve_sizes(world_size, tp, cp, pp, dp)
    check_ulysses(sizes["cp"], ulysses)
    sizes.update(ulysses=ulysses, ring=sizes["cp"] // ulysses)
    i = names.index("cp")  # the cp axis is two grid axes, Ulysses inside
    names[i:i + 1] = CP_SUBAXES
    # view() is row-major: the last dim is innermost, so reverse the order string.
    grid = torch.arange(world_size).view(*[sizes[n] for n in reversed(names)])
    dim_of = {n: len(names) - 1 - i for i, n in enumerate(names)}

    def family(axes: List[str]) -> List[List[int]]:
        axes = [s for a in axes for s in (CP_SUBAXES if a == "cp" else (a,))]
        dims = [dim_of[a] for a in axes]
        rest = [d for d in range(grid.dim()) if d not in dims]
        # (rest..., axes...) -> (num_groups, group_size)
        g = grid.permute(*rest, *sorted(dims)).reshape(-1, _prod(sizes[a] for a in axes))
        return [sorted(row.tolist()) for row in g]

    groups = {a: family([a]) for a in AXES + CP_SUBAXES}
    # Within one axis the order is the position along that axis (ascending ranks).
    groups["dp_cp"] = family(["dp", "cp"])
    if len(groups["dp_cp"][0]) % ep:
        raise ValueError(f"ep={ep} must divide dp x cp = {len(groups['dp_cp'][0])}")
    groups["ep"] = [g[i:i + ep] for g in groups["dp_cp"] for i in range(0, len(g), ep)]
    groups["edp"] = [g[i::ep] for g in groups["dp_cp"] for i in range(ep)]
    return groups


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def local_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK when CUDA is available (every launcher sets
    LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def default_backend(device: Optional[torch.device] = None) -> str:
    """nccl for CUDA devices, gloo otherwise (CPU tests, CPU training)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for single-machine rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env() -> None:
    """Make RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR set, whoever launched us.

    torchrun/deepspeed set them; under srun they come from SLURM_PROCID/NTASKS/LOCALID;
    a lone process gets rank 0 of 1. No communication: call it first, so even input
    checks and device choice before init_distributed see this rank's numbers.
    """
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        # srun python train.py: one task per GPU, rank/world from Slurm.
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")


CUDA_ALLOC_CONF = "expandable_segments:True"


def cuda_allocator_defaults(env=os.environ) -> str:
    """Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set it; returns
    the value in effect. Long contexts allocate activations and attention buffers of many
    sizes, and the caching allocator's fixed segments fragment under them; expandable
    segments grow one mapping instead (ALST and torchtitan set the same). torch reads it
    when CUDA's allocator starts, so call this before the first CUDA allocation (train.py
    and generate.py do, through init_distributed; tools/gpu_check.py does at its start)."""
    return env.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


def init_distributed(backend: Optional[str] = None, timeout_s: float = 1800.0) -> None:
    """Initialise torch.distributed from torchrun/deepspeed variables or, failing those, SLURM_*.

    No-op when already initialised. A single process with no launcher variables gets a
    world of one (MASTER_ADDR=127.0.0.1), so `python train.py` works on a laptop.
    """
    if dist.is_initialized():
        return
    launcher_env()
    env = os.environ
    if "MASTER_PORT" not in env:
        # A lone process (no launcher): any free port, so two such runs never collide.
        if env["WORLD_SIZE"] != "1":
            raise RuntimeError("MASTER_PORT is not set: launch with torchrun, deepspeed or srun")
        env["MASTER_PORT"] = str(free_port())
    backend = backend or default_backend()
    if backend == "nccl":
        cuda_allocator_defaults(env)  # before the first CUDA allocation of this process
        torch.cuda.set_device(int(env["LOCAL_RANK"]))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the TP x CP x PP x DP grid and the groups it belongs to."""

    order: str
    sizes: Dict[str, int]
    groups: Dict[str, List[List[int]]] = field(repr=False)  # every group of every family
    rank: int
    world_size: int
    tp_group: object = field(repr=False, default=None)
    cp_group: object = field(repr=False, default=None)
    pp_group: object = field(repr=False, default=None)
    dp_group: object = field(repr=False, default=None)
    dp_cp_group: object = field(repr=False, default=None)
    ulysses_group: object = field(repr=False, default=None)  # inner part of the cp group
    ring_group: object = field(repr=False, default=None)     # outer part of the cp group
    ep_group: object = field(repr=False, default=None)       # experts' split (in dp_cp)
    edp_group: object = field(repr=False, default=None)      # ranks with the same experts

    # Degrees ("*_size") and positions in a group ("*_rank").
    @property
    def tp_size(self) -> int: return self.sizes["tp"]
    @property
    def cp_size(self) -> int: return self.sizes["cp"]
    @property
    def pp_size(self) -> int: return self.sizes["pp"]
    @property
    def dp_size(self) -> int: return self.sizes["dp"]
    @property
    def dp_cp_size(self) -> int: return self.sizes["dp"] * self.sizes["cp"]
    @property
    def ulysses_size(self) -> int: return self.sizes["ulysses"]
    @property
    def ring_size(self) -> int: return self.sizes["ring"]

    @property
    def ep_size(self) -> int: return self.sizes.get("ep", 1)

    def ranks(self, family: str) -> List[int]:
        """Global ranks of this rank's group in a family ('tp', 'cp', 'pp', 'dp', 'dp_cp',
        'ulysses', 'ring')."""
        for g in self.groups[family]:
            if self.rank in g:
                return g
        raise AssertionError(f"rank {self.rank} in no {family} group")  # grid invariant

    @property
    def tp_rank(self) -> int: return self.ranks("tp").index(self.rank)
    @property
    def cp_rank(self) -> int: return self.ranks("cp").index(self.rank)
    @property
    def pp_rank(self) -> int: return self.ranks("pp").index(self.rank)
    @property
    def dp_rank(self) -> int: return self.ranks("dp").index(self.rank)
    @property
    def dp_cp_rank(self) -> int: return self.ranks("dp_cp").index(self.rank)
    @property
    def ulysses_rank(self) -> int: return self.ranks("ulysses").index(self.rank)
    @property
    def ring_rank(self) -> int: return self.ranks("ring").index(self.rank)

    # The CP ring: KV blocks go to the next rank and come from the previous one.
    @property
    def cp_next_rank(self) -> int:
        r = self.ranks("cp")
        return r[(self.cp_rank + 1) % len(r)]

    @property
    def cp_prev_rank(self) -> int:
        r = self.ranks("cp")
        return r[(self.cp_rank - 1) % len(r)]

    @property
    def is_pp_first_stage(self) -> bool: return self.pp_rank == 0
    @property
    def is_pp_last_stage(self) -> bool: return self.pp_rank == self.pp_size - 1


_STATE: Optional[ParallelState] = None  # the one accessor's state (set by init_parallel_state)


def init_parallel_state(tp: int = 1, cp: int = 1, pp: int = 1, dp: Union[int, str] = "auto",
                        order: str = DEFAULT_ORDER, backend: Optional[str] = None,
                        ulysses: int = 1, ep: int = 1) -> ParallelState:
    """Build the grid and create every process group (collective: call on all ranks).

    ulysses: the degree of the Ulysses part of each CP group (hybrid CP; 1 otherwise).
    Sizes and order are validated before any group exists, so a bad layout raises the
    same ValueError on every rank and nobody waits in new_group.
    """
    if not dist.is_initialized():
        init_distributed(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = rank_grid(world, tp, cp, pp, dp, order, ulysses, ep)  # raises before any collective
    sizes = resolve_sizes(world, tp, cp, pp, dp)
    sizes.update(ulysses=ulysses, ring=cp // ulysses, ep=ep)
    mine, made = {}, {}
    # new_group is collective over the whole world: every rank creates every group,
    # in the same order, and keeps the one it belongs to. A ulysses or ring group with
    # the ranks of a group made before (u = 1: ring = cp; u = cp: ulysses = cp; groups of
    # one) reuses that process group instead of opening another communicator.
    families = ("tp", "cp", "pp", "dp", "dp_cp", *CP_SUBAXES) + (("ep", "edp") if ep > 1 else ())
    for family in families:
        for ranks in groups[family]:
            key = tuple(ranks)
            if family in (*CP_SUBAXES, "ep", "edp") and key in made:
                pg = made[key]
            else:
                pg = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
                made.setdefault(key, pg)
            if rank in ranks:
                mine[family] = pg
    state = ParallelState(
        order="-".join(parse_order(order)), sizes=sizes, groups=groups, rank=rank,
        world_size=world, tp_group=mine["tp"], cp_group=mine["cp"], pp_group=mine["pp"],
        dp_group=mine["dp"], dp_cp_group=mine["dp_cp"], ulysses_group=mine["ulysses"],
        ring_group=mine["ring"], ep_group=mine.get("ep"),  # None: no expert parallelism
        edp_group=mine.get("edp", mine["dp_cp"]),
    )
    global _STATE
    _STATE = state
    return state


def get_parallel_state() -> ParallelState:
    """The state built by the last init_parallel_state() call on this process."""
    if _STATE is None:
        raise RuntimeError("init_parallel_state() has not been called on this process")
    return _STATE


def destroy_parallel_state() -> None:
    """Forget the current state. Its process groups live on while anything references
    them (destroy_process_group does not free them): see shutdown_distributed."""
    global _STATE
    _STATE = None


def shutdown_distributed() -> None:
    """The end of a distributed entrypoint, on every rank: a barrier (no rank tears its
    connections down while a peer still talks to it), the module's state forgotten,
    every process group destroyed, and the groups no one references any more freed now.

    Why not barrier + destroy_process_group alone: that leaves the module's state holding
    each rank's groups, so their gloo worker threads still run when the interpreter
    finalizes. A worker that then drops its last finished work (the barrier's, which
    keeps the all_gather before it and that one's Python-owned tensors) must take the
    GIL; CPython ends a thread that asks for the GIL during finalization with
    pthread_exit, whose unwinding through the work's noexcept destructor calls
    std::terminate: "terminate called without an active exception", SIGABRT after a
    correct answer, now and then under load (docs/parallelism.md, "Leaving cleanly").
    Freed before then, a group's destructor joins its workers (without the GIL) while
    the interpreter is whole. The caller's own references (a model, a ParallelState)
    go when it returns, before the exit.
    """
    if dist.is_initialized():
        dist.barrier()
    destroy_parallel_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups held only by reference cycles: freed here, not at exit
