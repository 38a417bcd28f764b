"""The layout planner (``python -m ctxpar.plan``), as a tool: see ctxpar/plan/__init__.py.

    python tools/plan.py --config configs/gpt7b_128k_3d.yaml --nodes 8 --gpu h100
"""
import sys

from ctxpar.plan.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
