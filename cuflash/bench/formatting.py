"""Markdown pieces the tables share: number cells, agreement lines, not-measured notes."""


def format_tflops(value):
    """TFLOP/s for a table cell: one decimal below 100."""
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def format_agreement(rows):
    """Lines giving each peer's largest forward-output distance from cuflash."""
    worst: dict[str, float] = {}
    for m in rows:
        if m.rel_error is not None:
            worst[m.impl] = max(worst.get(m.impl, 0.0), m.rel_error)
    if not worst:
        return []
    return [
        "",
        "Largest relative L2 distance of a forward output from cuflash's: "
        + ", ".join(f"{impl} {error:.1e}" for impl, error in worst.items()),
    ]


def format_notes(rows):
    """Lines saying why cells are empty, grouped by implementation and reason."""
    notes: dict[tuple[str, str], int] = {}
    for m in rows:
        if m.timing is None:
            notes[(m.impl, m.note)] = notes.get((m.impl, m.note), 0) + 1
    if not notes:
        return []
    return ["", "Not measured (–):", ""] + [
        f"- {impl}: {note} ({count} case{'s' if count > 1 else ''})"
        for (impl, note), count in notes.items()
    ]


def format_ratio(ratio):
    """A ratio for a table cell (``1.23x``), a dash for None."""
    return "–" if ratio is None else f"{ratio:.2f}x"


def format_us(seconds):
    """Seconds as microseconds for a table cell, a dash for None."""
    return "–" if seconds is None else f"{seconds * 1e6:.1f}"
