"""The README and docs/ link to each other by relative paths and heading anchors; a moved or renamed section breaks
them silently on GitHub, so every relative link must name a file that exists and, where it has one, a heading of it.
The README's first screen is the newcomer's index: it keeps the two commands and links every page in docs/."""

import os
import re

from tests.conftest import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files() -> list[str]:
    """README.md, docs/*.md and the READMEs inside the package and tools, relative to the repository root."""
    found = ["README.md"]
    for top in ("docs", "megatron_moe", "tools"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            found += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names if n.endswith(".md")]
    return sorted(found)


def without_code(text: str) -> str:
    """The text outside fenced code blocks (a `](` inside a code example is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(path: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown file: lower case, punctuation dropped, spaces to hyphens."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        headings = re.findall(r"^#+ (.+)$", without_code(f.read()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def broken_links(path: str) -> list[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = without_code(f.read())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(os.path.join(ROOT, resolved)):
            broken.append(f"{path}: ({target}): no file {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{path}: ({target}): no heading #{anchor} in {resolved}")
    return broken


def test_every_relative_link_and_anchor_resolves():
    files = markdown_files()
    assert {"README.md", "docs/flags.md", "docs/troubleshooting.md"} <= set(files)
    assert [b for f in files for b in broken_links(f)] == []


def test_a_broken_link_or_anchor_is_found(tmp_path, monkeypatch):
    """The check above can fail: a missing file and a missing heading are both reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Real heading\n\n[x](b.md) [y](#real-heading) [z](#gone)\n")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    assert broken_links("docs/a.md") == [
        "docs/a.md: (b.md): no file docs/b.md",
        "docs/a.md: (#gone): no heading #gone in docs/a.md",
    ]


def test_the_first_screen_has_the_two_commands_and_links_every_docs_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    first_screen = "\n".join(readme.splitlines()[:60])
    assert "## Two commands" in first_screen
    assert "make demo" in first_screen and "make test" in first_screen
    linked = {os.path.normpath(t.partition("#")[0]) for t in LINK.findall(first_screen)}
    pages = {f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")}
    assert pages - linked == set(), "docs pages missing from the README's first screen: add them to Documentation"
