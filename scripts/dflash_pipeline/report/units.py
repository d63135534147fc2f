"""Numbers as a reader wants them in the run's summary: with their unit, thousands separated, a sensible
number of digits, and never a Python repr (no dicts, lists, `True` or `None` in a cell)."""

from __future__ import annotations

NONE = "–"


def count(v) -> str:
    return NONE if v is None else f"{round(v):,}"


def tokens(v) -> str:
    return NONE if v is None else f"{round(v):,} tokens"


def tok_s(v) -> str:
    if v is None:
        return NONE
    return f"{v:,.0f} tok/s" if v >= 100 else f"{v:,.3g} tok/s"


def nbytes(v) -> str:
    if v is None:
        return NONE
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= size:
            return f"{v / size:,.2f} {unit}"
    return f"{round(v):,} B"


def seconds(v) -> str:
    if v is None:
        return NONE
    if v < 60:
        return f"{v:.3g} s" if v < 10 else f"{v:.0f} s"
    if v < 3600:
        return f"{int(v // 60)} min {v % 60:02.0f} s"
    return f"{int(v // 3600)} h {(v % 3600) / 60:02.0f} min"


def hours(v, what: str = "h", small: bool | None = None) -> str:
    """GPU-hours or job-hours; below 0.01 h in seconds of the same kind (`GPU-hours` -> `GPU-seconds`). `small`
    decides for a whole row (True: seconds, False: hours), so two cells never mix the units."""
    if v is None:
        return NONE
    if small if small is not None else 0 < v < 0.01:
        return f"{v * 3600:.3g} {what.replace('hours', 'seconds')}"
    return f"{v:,.1f} {what}" if v >= 10 else f"{v:.3g} {what}"


def mean_tokens(v) -> str:
    return NONE if v is None else f"{v:,.1f} tokens"


def percent(fraction) -> str:
    return NONE if fraction is None else f"{100 * fraction:.3g}%"


def ratio(v) -> str:
    """A ratio of two measures of the same thing, as a factor."""
    return NONE if v is None else f"{v:.3g}x"


def number(v) -> str:
    """A plain figure (loss, tau): four significant digits."""
    if v is None:
        return NONE
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"


def listing(values) -> str:
    """A list or mapping as words: `a, b` or `a: 1, b: 2`; empty as a dash."""
    if not values:
        return NONE
    if isinstance(values, dict):
        return ", ".join(f"{k}: {number(v) if not isinstance(v, str) else v}" for k, v in values.items())
    return ", ".join(str(v) for v in values)


def yes_no(v) -> str:
    return NONE if v is None else ("yes" if v else "no")
