"""A benchmark's results as JSON, with when, where and with what arguments they were taken.

    save_results(a.json, a, rows)    # rows plus date, torch, machine and the arguments
"""
from __future__ import annotations

import json
import os
import platform
from datetime import date

import torch


def save_results(path: str, args, rows, **meta) -> None:
    """Write {"meta": when, where, with what arguments; "rows": rows} as JSON to path."""
    meta = dict(date=str(date.today()), torch=torch.__version__, machine=platform.machine(),
                cpus=os.cpu_count(), args=vars(args), **meta)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {path}")
