"""Every relative link in the repository's Markdown resolves inside a clone (no links to files kept beside it)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_relative_links_resolve():
    bad = []
    for md in ROOT.rglob("*.md"):
        if any(part.startswith(".") or part in ("node_modules", "before_src") for part in md.relative_to(ROOT).parts):
            continue
        for m in re.finditer(r"\]\(([^)#\s]+)(#[^)]*)?\)", md.read_text(errors="replace")):
            target = m.group(1)
            if not target.startswith(("http://", "https://", "mailto:")) and not (md.parent / target).exists():
                bad.append(f"{md.relative_to(ROOT)}: {target}")
    assert not bad, "\n".join(bad)
