"""What the benchmarks show besides their JSON line: a progress bar and `--plot` figures.

The progress bar goes to stderr, only on a terminal, and only advances between rounds:
nothing of it runs inside a measured round. Plots need matplotlib (`pip install
'queryloop[bench]'`); without it `--plot` fails before anything is measured.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress(total: int, description: str) -> Iterator[Any]:
    """A bar of `total` steps on stderr; yields `advance()`. Silent when stderr is not a terminal."""
    console = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


def check_plot_target(path: str | None) -> Path | None:
    """Fail early (before minutes of measuring) if a plot was asked for and cannot be drawn."""
    if path is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install 'queryloop[bench]'")
    target = Path(path)
    if target.suffix.lower() != ".png":
        sys.exit(f"--plot writes a PNG file: {path!r} does not end in .png")
    return target


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def _figure(target: Path, title: str, xlabel: str, ylabel: str) -> Iterator[Any]:
    """Axes on a log x scale, labelled and titled; saved to `target` (PNG) when the block ends."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    try:
        yield axes
        axes.set_xscale("log")
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(target, dpi=120)
    finally:
        plt.close(figure)


def plot_throughput(target: Path, points: Sequence[dict[str, Any]], title: str) -> None:
    """Loops per second against concurrency, runtime and baseline, for each collector pair measured."""
    with _figure(target, title, "loops at once (concurrency)", "loops per second") as axes:
        levels = [p["concurrency"] for p in points]
        for suffix, note, style in (("", "GC tuned", "-"), ("_untuned", "GC untuned", "--"), ("_off", "GC off", ":")):
            if f"loops_per_s{suffix}" not in points[0]:
                continue
            ours = [p[f"loops_per_s{suffix}"] for p in points]
            axes.plot(levels, ours, marker="o", linestyle=style, label=f"queryloop runtime ({note})")
            base = [p[f"baseline_loops_per_s{suffix}"] for p in points]
            axes.plot(levels, base, marker="s", linestyle=style, label=f"baseline, plain trio loop ({note})")
            for level, rate, p in zip(levels, ours, points, strict=True):
                axes.annotate(
                    f"{p[f'throughput_ratio{suffix}']:.2f}",
                    (level, rate),
                    textcoords="offset points",
                    xytext=(0, -14),
                    ha="center",
                    fontsize=8,
                )


def plot_cdf(target: Path, series: Mapping[str, Sequence[float]], title: str) -> None:
    """The cumulative distribution of each series of latencies (seconds, drawn in milliseconds)."""
    with _figure(target, title, "abort call → result event (ms)", "fraction of aborts") as axes:
        for label, values in series.items():
            ordered = sorted(v * 1e3 for v in values)
            if not ordered:
                continue
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            axes.step(ordered, fractions, where="post", label=f"{label} (n={len(ordered)})")
        axes.axhline(0.99, color="grey", linewidth=0.8, linestyle=":")
