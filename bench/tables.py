"""Plain-text and markdown tables for the bench's reports (no dependencies)."""

from __future__ import annotations

__all__ = ["format_table"]


def format_table(title: str, columns, rows, *, markdown: bool) -> str:
  """One table: a `### title` markdown table, or right-aligned text under `== title`.

  Args:
    title: the table's title.
    columns: column names.
    rows: rows of already formatted cells (strings), one per column.
    markdown: markdown instead of aligned text.

  Returns:
    The text ("" without rows).
  """
  if not rows:
    return ""
  if markdown:
    out = [f"### {title}\n", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out.extend("| " + " | ".join(row) + " |" for row in rows)
  else:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    out = [f"== {title}"]
    out.append("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    out.extend("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in rows)
  return "\n".join(out) + "\n"
