"""Small inline-SVG charts for the HTML report: lines with points, grouped bars, horizontal bars.

Plain strings, no JavaScript, no external references (the SVG namespace is
implied when SVG sits inside HTML). Every data point is one element with a
`data-series` attribute, so a test can count them. Non-finite values are left
out of the drawing and named under the chart.
"""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT = 460, 250
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 30, 42
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000 or magnitude < 0.01:
        return f"{value:.2g}"
    return f"{value:.3g}"


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    raw = (hi - lo) / max(count - 1, 1)
    step = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for multiple in (1, 2, 2.5, 5, 10):
        if step * multiple >= raw:
            step *= multiple
            break
    start = math.floor(lo / step) * step
    ticks, value = [], start
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def _domain(values: list[float], fixed: tuple[float, float] | None) -> tuple[float, float]:
    if fixed is not None:
        return fixed
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.1 or 0.5
        lo, hi = lo - pad, hi + pad
    ticks = _ticks(lo, hi)
    return min(ticks[0], lo), max(ticks[-1], hi)


def _frame(title: str, y_label: str, x_label: str) -> list[str]:
    return [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<text x="8" y="18" class="chart-title">{escape(title)}</text>',
        f'<text x="{LEFT + (WIDTH - LEFT - RIGHT) / 2:.1f}" y="{HEIGHT - 6}" class="axis-label" '
        f'text-anchor="middle">{escape(x_label)}</text>',
        f'<text x="12" y="{TOP + (HEIGHT - TOP - BOTTOM) / 2:.1f}" class="axis-label" text-anchor="middle" '
        f'transform="rotate(-90 12 {TOP + (HEIGHT - TOP - BOTTOM) / 2:.1f})">{escape(y_label)}</text>',
    ]


def _y_axis(lo: float, hi: float, percent: bool) -> tuple[list[str], callable]:
    plot_h = HEIGHT - TOP - BOTTOM

    def y_of(value: float) -> float:
        return TOP + plot_h * (1 - (value - lo) / (hi - lo))

    parts = [f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" class="axis"/>']
    for tick in _ticks(lo, hi):
        if lo - 1e-9 <= tick <= hi + 1e-9:
            y = y_of(tick)
            label = f"{tick:.0%}" if percent else _fmt(tick)
            parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" class="grid"/>')
            parts.append(f'<text x="{LEFT - 5}" y="{y + 4:.1f}" class="tick" text-anchor="end">{label}</text>')
    return parts, y_of


def _legend(names: list[str]) -> list[str]:
    """Swatches in the top-right corner, beside the title."""
    parts = []
    x = WIDTH - RIGHT - 130 * len(names)
    for i, name in enumerate(names):
        cx = x + i * 130
        parts.append(f'<rect x="{cx:.1f}" y="9" width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>')
        parts.append(f'<text x="{cx + 14:.1f}" y="18" class="tick">{escape(name)}</text>')
    return parts


def line_chart(title: str, series: dict[str, list[tuple[int, float | None]]], x_label: str, y_label: str,
               percent: bool = False) -> str:
    """One polyline and one <circle class="point"> per finite (x, y) of each series; x are cycle indices."""
    finite = {name: [(x, y) for x, y in points if y is not None and math.isfinite(y)] for name, points in series.items()}
    dropped = [f"{name} at cycle {x + 1}" for name, points in series.items() for x, y in points
               if y is not None and not math.isfinite(y)]
    xs = sorted({x for points in series.values() for x, _ in points}) or [0]
    lo, hi = _domain([y for points in finite.values() for _, y in points], (0.0, 1.0) if percent else None)
    parts = _frame(title, y_label, x_label)
    axis, y_of = _y_axis(lo, hi, percent)
    parts += axis
    plot_w = WIDTH - LEFT - RIGHT
    span = max(xs[-1] - xs[0], 1)

    def x_of(x: int) -> float:
        return LEFT + plot_w * ((x - xs[0]) / span if len(xs) > 1 else 0.5)

    stride = max(1, math.ceil(len(xs) / 12))
    parts.append(f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" class="axis"/>')
    for x in xs[::stride]:
        parts.append(f'<text x="{x_of(x):.1f}" y="{HEIGHT - BOTTOM + 14}" class="tick" text-anchor="middle">{x + 1}</text>')
    for i, (name, points) in enumerate(finite.items()):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{x_of(x):.1f},{y_of(y):.1f}" for x, y in points)
        if len(points) > 1:
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2" class="line"/>')
        for x, y in points:
            shown = f"{y:.1%}" if percent else f"{y:.4g}"
            parts.append(f'<circle class="point" data-series="{slug(name)}" cx="{x_of(x):.1f}" cy="{y_of(y):.1f}" '
                         f'r="3.5" fill="{color}"><title>{escape(name)}, cycle {x + 1}: {shown}</title></circle>')
    if len(finite) > 1:
        parts += _legend(list(finite))
    parts.append("</svg>")
    note = f'<p class="note">not drawn (not finite): {escape(", ".join(dropped))}</p>' if dropped else ""
    return "".join(parts) + note


def bar_chart(title: str, groups: list[str], series: dict[str, list[float | None]], y_label: str,
              percent: bool = True) -> str:
    """Grouped vertical bars: one <rect class="bar"> per finite value of each series in each group."""
    values = [v for vs in series.values() for v in vs if v is not None and math.isfinite(v)]
    lo, hi = (0.0, 1.0) if percent else (0.0, _domain(values + [0.0], None)[1])
    parts = _frame(title, y_label, "")
    axis, y_of = _y_axis(lo, hi, percent)
    parts += axis
    plot_w = WIDTH - LEFT - RIGHT
    group_w = plot_w / max(len(groups), 1)
    bar_w = group_w * 0.7 / max(len(series), 1)
    for g, group in enumerate(groups):
        gx = LEFT + g * group_w + group_w * 0.15
        parts.append(f'<text x="{LEFT + (g + 0.5) * group_w:.1f}" y="{HEIGHT - BOTTOM + 14}" class="tick" '
                     f'text-anchor="middle">{escape(group)}</text>')
        for s, (name, vs) in enumerate(series.items()):
            v = vs[g]
            if v is None or not math.isfinite(v):
                continue
            y = y_of(v)
            shown = f"{v:.1%}" if percent else _fmt(v)
            parts.append(f'<rect class="bar" data-series="{slug(name)}" x="{gx + s * bar_w:.1f}" y="{y:.1f}" '
                         f'width="{bar_w - 2:.1f}" height="{HEIGHT - BOTTOM - y:.1f}" '
                         f'fill="{PALETTE[s % len(PALETTE)]}"><title>{escape(name)}, {escape(group)}: {shown}</title></rect>')
            parts.append(f'<text x="{gx + s * bar_w + (bar_w - 2) / 2:.1f}" y="{y - 3:.1f}" class="tick" '
                         f'text-anchor="middle">{shown}</text>')
    parts.append(f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" class="axis"/>')
    parts += _legend(list(series))
    parts.append("</svg>")
    return "".join(parts)


def hbar_chart(title: str, rows: list[tuple[str, float]], unit: str, formatter=None) -> str:
    """Horizontal bars, one per labelled value (stage totals); the height grows with the rows."""
    formatter = formatter or (lambda v: f"{_fmt(v)} {unit}")
    row_h, label_w, top = 20, 120, 30
    height = top + row_h * len(rows) + 10
    peak = max([v for _, v in rows if math.isfinite(v)] + [1e-12])
    plot_w = WIDTH - label_w - 80
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" '
             f'aria-label="{escape(title)}">', f"<title>{escape(title)}</title>",
             f'<text x="8" y="18" class="chart-title">{escape(title)}</text>']
    for i, (label, value) in enumerate(rows):
        y = top + i * row_h
        width = plot_w * max(value, 0) / peak if math.isfinite(value) else 0
        parts.append(f'<text x="{label_w - 6}" y="{y + 13}" class="tick" text-anchor="end">{escape(label)}</text>')
        parts.append(f'<rect class="bar" data-series="{slug(title)}" x="{label_w}" y="{y + 2}" width="{width:.1f}" '
                     f'height="{row_h - 5}" fill="{PALETTE[0]}"><title>{escape(label)}: {escape(formatter(value))}'
                     f'</title></rect>')
        parts.append(f'<text x="{label_w + width + 4:.1f}" y="{y + 13}" class="tick">{escape(formatter(value))}</text>')
    parts.append("</svg>")
    return "".join(parts)
