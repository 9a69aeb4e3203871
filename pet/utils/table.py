"""Plain-text tables for logs: hook costs, AP tables, dataset statistics."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def format_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with aligned columns (numbers right-aligned)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = []
    for row in (header, *rows):
        cells = [
            str(cell).rjust(width) if i and _looks_numeric(cell) else str(cell).ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _looks_numeric(cell: Any) -> bool:
    try:
        float(cell)
    except (TypeError, ValueError):
        return False
    return True
