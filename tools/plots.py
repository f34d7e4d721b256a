"""Line charts as SVG, for the benchmark pages (docs/benchmarks/*.svg), written by hand.

No plotting library: the benchmarks run in the test environment, and a chart needs only
axes, ticks, lines and a legend. The same data gives byte-identical files (numbers are
rounded before they are printed), so a chart in the repository changes only when its
data does. One call per chart, from the benchmark that measured the data:

    from plots import Series, line_chart
    line_chart("docs/benchmarks/speedup_resnet50.svg", "ResNet50 inference, bfloat16 vs float32",
               x_label="batch size", y_label="speed-up (×)",
               series=[Series("ours", ((1, 1.2), (8, 1.9), (32, 2.1))),
                       Series("Keras mixed_bfloat16", ((1, 1.0), (8, 1.6), (32, 1.8)))],
               log_x=True, reference_y=1.0)

    .venv/bin/python tools/plots.py --smoke    # draws a sample chart into a temporary directory
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 640, 360
LEFT, RIGHT, TOP, BOTTOM = 64, 180, 36, 48  # margins: the legend sits on the right
# Colour-blind-safe (Okabe-Ito), in series order.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")


@dataclass(frozen=True)
class Series:
    """One line: its legend label and its (x, y) points in x order."""

    label: str
    points: tuple[tuple[float, float], ...]


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if m * step >= raw)
    first = math.floor(low / step) * step
    return [round(first + i * step, 10) for i in range(int(math.ceil((high - first) / step)) + 1)]


def _number(value: float) -> str:
    return f"{value:.4g}"


def line_chart(path: str | os.PathLike[str], title: str, *, x_label: str, y_label: str,
               series: Sequence[Series], log_x: bool = False, reference_y: float | None = None) -> Path:
    """Write ``series`` as one SVG line chart at ``path`` (folders created); returns the path.

    ``log_x``: x on a base-2 log scale (batch sizes, model sizes). ``reference_y``: a dashed
    horizontal line (1.0 for speed-ups: above it is faster)."""
    if not series or not all(s.points for s in series):
        raise ValueError(f"{path}: every series needs at least one point")
    scale_x = (lambda x: math.log2(x)) if log_x else (lambda x: x)
    xs = [scale_x(x) for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points] + ([reference_y] if reference_y is not None else [])
    x_ticks = sorted({x for s in series for x, _ in s.points}) if log_x else _ticks(min(xs), max(xs))
    y_ticks = _ticks(min(ys), max(ys))
    x_low, x_high = (min(xs), max(xs)) if log_x else (x_ticks[0], x_ticks[-1])
    x_high = x_high if x_high > x_low else x_low + 1
    y_low, y_high = y_ticks[0], y_ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> str:
        return _number(LEFT + (scale_x(x) - x_low) / (x_high - x_low) * plot_w)

    def py(y: float) -> str:
        return _number(TOP + plot_h - (y - y_low) / (y_high - y_low) * plot_h)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}"'
           ' font-family="Helvetica, Arial, sans-serif" font-size="12">',
           f'<title>{escape(title)}</title>', '<rect width="100%" height="100%" fill="#ffffff"/>',
           f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    for y in y_ticks:
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(y)}" y2="{py(y)}" stroke="#e5e5e5"/>'
                   f'<text x="{LEFT - 6}" y="{py(y)}" text-anchor="end" dominant-baseline="middle">{_number(y)}</text>')
    for x in x_ticks:
        out.append(f'<text x="{px(x)}" y="{TOP + plot_h + 16}" text-anchor="middle">{_number(x)}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888888"/>')
    if reference_y is not None:
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(reference_y)}" y2="{py(reference_y)}"'
                   ' stroke="#555555" stroke-dasharray="4 3"/>')
    out.append(f'<text x="{LEFT + plot_w / 2:.4g}" y="{HEIGHT - 10}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text transform="translate(16 {TOP + plot_h / 2:.4g}) rotate(-90)" text-anchor="middle">'
               f'{escape(y_label)}</text>')
    for index, line in enumerate(series):
        colour = COLOURS[index % len(COLOURS)]
        points = " ".join(f"{px(x)},{py(y)}" for x, y in line.points)
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out += [f'<circle cx="{px(x)}" cy="{py(y)}" r="3" fill="{colour}"><title>{escape(line.label)}:'
                f' {_number(x)}, {_number(y)}</title></circle>' for x, y in line.points]
        legend_y = TOP + 8 + index * 18
        out.append(f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 32}" y1="{legend_y}" y2="{legend_y}"'
                   f' stroke="{colour}" stroke-width="2"/><text x="{WIDTH - RIGHT + 38}" y="{legend_y}"'
                   f' dominant-baseline="middle">{escape(line.label)}</text>')
    out.append("</svg>")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(out) + "\n", encoding="utf-8")
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="draw a sample chart into a temporary directory")
    args = parser.parse_args(argv)
    if not args.smoke:
        parser.error("this module is a library for the benchmarks; --smoke draws a sample")
    with tempfile.TemporaryDirectory() as directory:
        path = line_chart(Path(directory) / "sample.svg", "sample: speed-up by batch size", x_label="batch size",
                          y_label="speed-up (×)", log_x=True, reference_y=1.0,
                          series=[Series("ours", ((1, 1.1), (8, 1.8), (64, 2.2))),
                                  Series("peer", ((1, 0.9), (8, 1.5), (64, 1.9)))])
        print(f"{path.name}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
