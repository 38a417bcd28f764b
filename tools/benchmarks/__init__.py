"""Benchmarks, run from the repository root as modules: python -m tools.benchmarks.bench_x.

Their results and the commands that produced them are in docs/benchmarks.md.
"""
