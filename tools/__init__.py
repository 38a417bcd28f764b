"""The user's commands (run as scripts: python tools/plan.py ...); benchmarks/ below."""
