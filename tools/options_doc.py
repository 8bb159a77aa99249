"""Render docs/options.md: every environment setting fxpar reads, from its one declaration
(fxpar.core.options.OPTIONS). tests/unit/test_options.py checks the committed page is fresh::

    python tools/options_doc.py            # rewrite docs/options.md
    python tools/options_doc.py --check    # exit 1 when docs/options.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fxpar.core.options import OPTIONS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "options.md"


def render() -> str:
    lines = [
        "# Options: the environment settings fxpar reads",
        "",
        "Each is declared once, in `fxpar/core/options.py`, and read when it is needed (never "
        "at import time); an explicit argument or flag wins over the environment. This page "
        "is generated from the declarations (`python tools/options_doc.py`).",
        "",
        "| variable | values | unset | what it does |",
        "|---|---|---|---|",
    ]
    for option in OPTIONS.values():
        unset = f"`{option.default}`" if option.default else "-"
        values = option.values.replace(" | ", ", ")  # a bar would split the table cell
        lines.append(f"| `{option.env}` | `{values}` | {unset} | {option.doc} |")
    lines += ["", "The test suite's own switches (`FXPAR_LIBRARY_MATRIX`, `FXPAR_FUZZ_EXAMPLES`, "
              "...) are listed in [testing.md](testing.md).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        stale = not DOC.exists() or DOC.read_text() != text
        if stale:
            print(f"{DOC} is stale: run python tools/options_doc.py")
        return int(stale)
    DOC.write_text(text)
    print(f"wrote {DOC} ({len(OPTIONS)} options)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
