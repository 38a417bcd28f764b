"""The layout planner (``python -m ctxpar.plan``), as a tool: see ctxpar/plan/__init__.py.

    python tools/plan.py --config configs/gpt7b_128k_3d.yaml --nodes 8 --gpu h100
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ctxpar.plan.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
