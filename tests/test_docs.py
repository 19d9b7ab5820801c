"""The documentation: the generated config reference is current, every relative link resolves, the README opens
with the two commands a newcomer needs, and the docs hold no session history."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _load_config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are examples, not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (not - or _), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_configuration_md_is_generated_from_config_py():
    """docs/configuration.md is exactly what scripts/config_reference.py writes from hetero_spec/config.py."""
    expected = _load_config_reference().render()
    committed = (DOCS / "configuration.md").read_text()
    assert committed == expected, ("docs/configuration.md is stale (a config field or its docstring changed): "
                                   "run `.venv/bin/python scripts/config_reference.py` and commit the result")


def test_configuration_md_documents_every_field():
    from pydantic import BaseModel

    from hetero_spec.config import Config

    text = (DOCS / "configuration.md").read_text()

    def walk(model: type[BaseModel], prefix: str):
        for name, info in model.model_fields.items():
            path = prefix + name
            if info.exclude:
                continue
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from walk(ann, path + ".")
            else:
                yield path

    missing = [p for p in walk(Config, "") if f"`{p}`" not in text]
    assert not missing, f"fields missing from docs/configuration.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    """Every relative Markdown link (and image) points to a file that exists, and its #anchor to a heading."""
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_opens_with_make_demo_and_make_test():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; keep it at most 250 (move detail into docs/)"
    assert lines[0].startswith("# ")
    body = [line for line in lines[1:] if line.strip()]
    assert body[0].startswith("```"), "the README opens with the commands, right under its title"
    block = body[1:body.index("```", 1)]
    commands = [line.split("#")[0].strip() for line in block if line.split("#")[0].strip()]
    assert commands[:2] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


HISTORY = {
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "an issue number": re.compile(r"\bissues?\s+#?\d+", re.I),
    "a path into bench-out/": re.compile(r"bench-out/"),
}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_session_history(page: Path):
    """Docs describe what is, not how it came to be: no commit hashes, dates, issue numbers, or paths to results
    that are not in the repository."""
    text = page.read_text()
    found = [f"{what}: {m.group(0)!r}" for what, rx in HISTORY.items() for m in rx.finditer(text)]
    assert not found, f"{page.relative_to(ROOT)}: " + "; ".join(found)
