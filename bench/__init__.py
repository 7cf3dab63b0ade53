"""queryloop's benchmarks: `python -m bench NAME`.

Each prints ratios to an in-run baseline and a JSON last line.
"""
