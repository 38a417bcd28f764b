"""A benchmark's results as JSON, with when, where and with what arguments they were taken.

    save_results(a.json, a, rows)    # rows plus date, torch, machine and the arguments
    measure_missing(CASES, results, run, describe, only=a.only, save=a.save)
"""
from __future__ import annotations

import json
import os
import platform
from datetime import date
from typing import Any, Callable, Dict, Optional

import torch


def save_results(path: str, args, rows, **meta) -> None:
    """Write {"meta": when, where, with what arguments; "rows": rows} as JSON to path."""
    meta = dict(date=str(date.today()), torch=torch.__version__, machine=platform.machine(),
                cpus=os.cpu_count(), args=vars(args), **meta)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {path}")


def measure_missing(cases: Dict[str, Any], results: Dict[str, dict],
                    run: Callable[[str, Any], dict], describe: Callable[[str, dict], str],
                    only: str = "", save: Optional[str] = None) -> None:
    """results[name] = run(name, case) for each case whose name contains `only` and that
    results lacks (a --load file's rows are kept); prints describe(name, row) after each,
    and with `save` rewrites that JSON file after each, so a long sweep cut short keeps
    what it measured and a rerun with --load picks up where it stopped."""
    for name, case in cases.items():
        if only not in name or name in results:
            continue
        results[name] = run(name, case)
        print(describe(name, results[name]), flush=True)
        if save:
            with open(save, "w") as f:
                json.dump(results, f, indent=1)
