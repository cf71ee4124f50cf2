"""Words that age, checked: the README stays short enough to read top to bottom, no code or doc
cites a ticket number (the why belongs in the text, provenance in the JSON and the git log), and
every measurement table in the docs is rendered from its JSON (``bench/render_results.py``)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICKET = re.compile(r"\bissues? #?\d+", re.I)
DECIMAL = re.compile(r"\d+\.\d+")
NOT_A_FIGURE = re.compile(r"`[^`]*`|\d+\.\d+\.\d+|\b(?:onnxruntime-genai|tritonserver|TensorRT-LLM) \d+\.\d+")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def _tickets(paths: list[Path]) -> list[str]:
    return [f"{p.name}:{i}: {m.group(0)}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) for m in TICKET.finditer(line)]


def hand_typed_tables(text: str) -> list[int]:
    """First lines of the Markdown tables outside ``<!-- rendered -->`` blocks where a quarter or more of
    the body's cells hold a decimal figure (measurements typed by hand); tables of names, flags, code
    and versions pass."""
    found, start, rendered = [], None, False
    lines = text.splitlines() + [""]
    for i, line in enumerate(lines):
        rendered = (rendered or line.startswith("<!-- rendered:")) and not line.startswith("<!-- /rendered")
        if line.startswith("|") and not rendered:
            start = i if start is None else start
            continue
        cells = [c for row in lines[start + 2:i] for c in row.strip("|").split("|")] if start is not None else []
        if cells and 4 * sum(bool(DECIMAL.search(NOT_A_FIGURE.sub("", c))) for c in cells) >= len(cells):
            found.append(start + 1)
        start = None
    return found


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200: the rest belongs in docs/)"


def test_no_ticket_numbers_in_code_or_docs():
    assert _tickets(_tracked("*.py", "*.md", "*.toml", ".ci/*")) == []


def test_the_ticket_scan_sees_one(tmp_path):
    p = tmp_path / "x.py"
    ticket = "issue" + " 12"  # spelled apart, so this file passes its own scan
    p.write_text(f'"""Built for {ticket}."""\nissues = 3  # not a ticket\n')
    assert [t.split(": ", 1)[1] for t in _tickets([p])] == [ticket]


def test_readme_has_no_hand_typed_measurement_table():
    assert hand_typed_tables((ROOT / "README.md").read_text()) == []


def test_the_table_scan_tells_rendered_from_typed():
    text = ("| a | b |\n|---|---|\n| x | 1.25 |\n\n| a | b |\n|---|---|\n| `--x 0.1` | onnxruntime-genai 0.18 |\n\n<!-- rendered: n f.json -->\n| a | b |\n|---|---|\n| x | 2.5 |\n"
            "<!-- /rendered -->\n\n| name | version |\n|---|---|\n| torch | 2 |\n")
    assert hand_typed_tables(text) == [1]
