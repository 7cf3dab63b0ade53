"""queryloop's benchmarks: `python -m bench NAME`.

Each prints ratios to an in-run baseline and a JSON last line. The two sides of a ratio take turns at
going first in a round, and run under the same collector settings (bench/collector.py): `loops` and
`abort` measure a tuned pair (the runtime opened with `Runtime.open(tune_gc=True)`, the baseline under
the same thresholds) and an untuned one (both at Python's defaults) in one run; `stream` both sides
tuned; `kernel` and `scale` run whole under `tune_gc=True` (docs/collector.md). Each takes
`--profile FILE` (bench/profiling.py).
"""
