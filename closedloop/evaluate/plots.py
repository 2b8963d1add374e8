"""PNG plots for the core report (matplotlib's Agg canvas; no pyplot, no global state).

Every function takes plain numbers (``None`` = not measured) and returns PNG bytes. A panel
without data says so in the figure instead of drawing a zero.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["plot_grad_mass", "plot_learning_curves", "plot_success", "plot_termination",
           "plot_training"]

Series = Sequence[float | None]
_DPI = 80


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not measured", ha="center", va="center",
            transform=ax.transAxes, color="#888")
    ax.set_xticks([])
    ax.set_yticks([])


def _points(xs: Series, ys: Series) -> tuple[list[float], list[float]]:
    pairs = [(float(x), float(y)) for x, y in zip(xs, ys, strict=False)
             if x is not None and y is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_success(rows: Sequence[tuple[str, float | None, float | None, float | None]],
                 title: str = "held-out success (pass@1) with 95% bootstrap CI") -> bytes:
    """Bars of held-out success per row (label, estimate, lo, hi)."""
    fig = Figure(figsize=(6.5, 3.2))
    ax = fig.add_subplot()
    measured = [(r[0], r[1], r[2], r[3]) for r in rows if r[1] is not None]
    if not measured:
        _no_data(ax, "held-out success")
    else:
        labels = [m[0] for m in measured]
        est = [float(m[1] or 0.0) for m in measured]
        lo = [e - (m[2] if m[2] is not None else e) for e, m in zip(est, measured, strict=True)]
        hi = [(m[3] if m[3] is not None else e) - e for e, m in zip(est, measured, strict=True)]
        ax.bar(labels, est, yerr=[lo, hi], capsize=6, color="#4c78a8")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("success rate")
    ax.set_title(title, fontsize=10)
    return _png(fig)


def plot_learning_curves(curves: Mapping[str, Series]) -> bytes:
    """Train success against environment interactions, action tokens and wall time."""
    fig = Figure(figsize=(9.5, 3.0))
    success = curves.get("train_success", [])
    for i, (key, label) in enumerate((("interactions", "environment interactions"),
                                      ("action_tokens", "action tokens"),
                                      ("wall_s", "wall time (s)"))):
        ax = fig.add_subplot(1, 3, i + 1)
        xs, ys = _points(curves.get(key, []), success)
        if not xs:
            _no_data(ax, "train success")
        else:
            ax.plot(xs, ys, marker="o", color="#f58518")
            ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel(label)
        ax.set_ylabel("train success" if i == 0 else "")
    fig.suptitle("learning curves (cumulative x)", fontsize=10)
    return _png(fig)


def plot_training(steps: Sequence[int], series: Mapping[str, Series]) -> bytes:
    """One panel per named per-step series (KL, gradient norm, entropy, ratio tails...)."""
    names = list(series)
    fig = Figure(figsize=(9.5, 2.8 * ((len(names) + 2) // 3)))
    for i, name in enumerate(names):
        ax = fig.add_subplot((len(names) + 2) // 3, 3, i + 1)
        xs, ys = _points(list(steps), series[name])
        if not xs:
            _no_data(ax, name)
        else:
            ax.plot(xs, ys, marker="o")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("RL step")
    return _png(fig)


def plot_grad_mass(shares: Mapping[str, float | None]) -> bytes:
    """Gradient-mass shares by length band and by success/failure."""
    fig = Figure(figsize=(8, 2.8))
    for i, keys in enumerate((("short", "medium", "long"), ("success", "failure"))):
        ax = fig.add_subplot(1, 2, i + 1)
        vals = [shares.get(k) for k in keys]
        if all(v is None for v in vals):
            _no_data(ax, "gradient mass")
        else:
            ax.bar(list(keys), [float(v or 0.0) for v in vals], color="#54a24b")
            ax.set_ylim(0, 1.05)
        ax.set_title("by length band" if i == 0 else "by outcome", fontsize=9)
        ax.set_ylabel("share of |∂L/∂log π|")
    return _png(fig)


def plot_termination(dists: Mapping[str, Mapping[str, int]]) -> bytes:
    """Termination-code counts per phase (train, eval start, eval final)."""
    fig = Figure(figsize=(9, 3.2))
    ax = fig.add_subplot()
    codes = sorted({c for d in dists.values() for c in d})
    if not codes:
        _no_data(ax, "terminations")
        return _png(fig)
    width = 0.8 / max(1, len(dists))
    for j, (phase, dist) in enumerate(dists.items()):
        ax.bar([i + j * width for i in range(len(codes))], [dist.get(c, 0) for c in codes],
               width=width, label=phase)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(codes))])
    ax.set_xticklabels(codes, rotation=20, fontsize=8)
    ax.set_ylabel("episodes")
    ax.legend(fontsize=8)
    ax.set_title("termination distribution", fontsize=10)
    return _png(fig)
