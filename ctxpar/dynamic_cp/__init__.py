"""Dynamic context parallelism (data.dynamic_cp): each step, every whole document gets the
smallest CP degree whose ranks hold it and a rank group of that size, so short documents
run without CP and long ones over many ranks (docs/parallelism.md, "Dynamic CP").

The feature, one concern a file, in the order a step meets them:

    schedule.py  pure: the step's documents, each one's CP size and tile of ranks, the
                 packs every rank runs and in which order (Schedule); static_schedule, the
                 fixed-cp packing it is compared with
    balance.py   pure: the step's work bound, the schedule given more ranks per document
                 until it is near that bound, documents traded within a window of steps
    stream.py    the training documents of a token file, one DynamicStep per step (its
                 documents, schedule and token count), the resumable position; the CP sizes
                 a run's pattern allows (dynamic_cp_sizes_for)
    groups.py    the process groups of every tile, built once at start (collective), and
                 under cp_comm 'hybrid' each tile's Ulysses and ring groups
    batch.py     one pack as a micro-batch: its documents packed and padded, cut to this
                 rank under the layout (document masking, positions restarting)

Outside this package, each where its owner lives: the planner's cost of a sequence at a
CP size, which the schedule balances (ctxpar/plan/sequence_cost.py), and its static-or-
dynamic advice for a length distribution (ctxpar/plan/dynamic.py); the model's step over
the packs (models/dynamic_cp.py, run by train.py's DynamicSteps in models/training.py).
"""
