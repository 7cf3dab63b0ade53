"""queryloop's benchmarks: `python -m bench NAME`.

Each prints ratios to an in-run baseline and a JSON last line. queryloop owns this process: the
runtime side opens its runtime with `Runtime.open(tune_gc=True)` (`loops` and `abort` take
`--no-tune-gc`); the baseline runs at Python's defaults (docs/collector.md).
"""
