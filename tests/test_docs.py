"""docs/ stays a set of reference pages that match the code.

- design.md names only code that exists: every path it cites in backticks is a file or folder of
  the repository, every identifier or dotted name is defined (or used as a key) in specbuild/, and
  every `--option` appears in specbuild/'s source.
- No page is a log: none runs past MAX_LINES, and no heading carries a date (history lives in git
  and CHANGELOG.md; figures on dated pages, docs/benchmarks/<date>-<machine>.md, which keep their
  date in the file name and may use it in headings).
- Relative links in README.md and docs/ lead to files that exist, and their #anchors to headings
  of those files.
"""

from __future__ import annotations

import ast
import builtins
import functools
import keyword
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "specbuild")
DOCS = os.path.join(ROOT, "docs")
MAX_LINES = 400
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
DATED_PAGE = re.compile(r"^20\d\d-[01]\d-[0-3]\d-[a-z0-9-]+\.md$")  # docs/benchmarks/<date>-<machine>.md
ROOTS = ("specbuild", "tests", "scripts", "docs")


def doc_pages() -> list[str]:
    """Every Markdown page under docs/, relative to the repository root."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))


def is_dated_page(rel: str) -> bool:
    return os.path.dirname(rel) == os.path.join("docs", "benchmarks") and bool(DATED_PAGE.match(os.path.basename(rel)))


def headings(text: str) -> list[str]:
    """ATX headings outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def page_problems(rel: str, text: str) -> list[str]:
    """Why a page reads as a log: too long, or a heading that carries a date (dated pages under
    docs/benchmarks/ may date their headings)."""
    out = []
    n = len(text.splitlines())
    if n > MAX_LINES:
        out.append(f"  {rel}: {n} lines (over {MAX_LINES}: split it, or move figures to docs/benchmarks/)")
    if not is_dated_page(rel):
        out += [f"  {rel}: dated heading: {h}" for h in headings(text) if DATE.search(h)]
    return out


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def test_pages_are_reference_pages_not_logs():
    bad = [p for rel in doc_pages() for p in page_problems(rel, read(rel))]
    assert not bad, "pages that read as logs (history belongs in git and CHANGELOG.md, figures in " \
                    "docs/benchmarks/<date>-<machine>.md):\n" + "\n".join(bad)


def test_page_problems_catch_long_pages_and_dated_headings():
    short = "# Title\n\nText.\n"
    assert page_problems("docs/x.md", short) == []
    assert page_problems("docs/x.md", "line\n" * (MAX_LINES + 1))[0].endswith(f"(over {MAX_LINES}: split it, "
                                                                             "or move figures to docs/benchmarks/)")
    assert page_problems("docs/x.md", "line\n" * MAX_LINES) == []
    dated = "# Title\n\n## Threads (2026-12-02, AMD EPYC)\n\n```\n# 2026-12-03 in a fence is a comment\n```\n"
    assert page_problems("docs/x.md", dated) == ["  docs/x.md: dated heading: Threads (2026-12-02, AMD EPYC)"]
    assert page_problems("docs/benchmarks/2026-12-02-amd-epyc.md", dated) == []
    assert page_problems("docs/benchmarks/notes.md", dated) != []  # only <date>-<machine>.md may
    assert page_problems("docs/x.md", "Measured on 2026-12-02, in prose.\n") == []


def test_benchmark_pages_are_named_by_date_and_machine():
    bench = os.path.join(DOCS, "benchmarks")
    names = sorted(os.listdir(bench)) if os.path.isdir(bench) else []
    bad = [n for n in names if not DATED_PAGE.match(n)]
    assert not bad, f"docs/benchmarks/ holds one page per machine and date, <date>-<machine>.md: {bad}"
    assert DATED_PAGE.match("2026-12-06-intel-xeon.md") and not DATED_PAGE.match("intel-xeon.md")


# ---- links ----------------------------------------------------------------------------------
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline code and emphasis marks dropped,
    punctuation other than '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: str) -> frozenset[str]:
    with open(path, encoding="utf-8") as f:
        seen: dict[str, int] = {}
        out = set()
        for h in headings(f.read()):
            s = slug(h)
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
        return frozenset(out)


def test_slug_matches_github():
    assert slug("The fused stack, `--activations auto` and the Xeon") == \
        "the-fused-stack---activations-auto-and-the-xeon"
    assert slug("Row invariance: lossless in rounded formats") == "row-invariance-lossless-in-rounded-formats"
    assert slug("The compiled layer stack (`--compile`)") == "the-compiled-layer-stack---compile"


def link_problems(path: str, text: str) -> list[str]:
    """Relative links of the page at `path` (absolute) whose file or #anchor does not exist; links
    inside fenced blocks and inline code are not links."""
    here, rel, bad = os.path.dirname(path), os.path.relpath(path, ROOT), []
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    for target in LINK.findall(prose):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, file)) if file else path
        if not os.path.exists(full):
            bad.append(f"  {rel}: {target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            bad.append(f"  {rel}: {target}: no heading with that anchor")
    return bad


def test_relative_links_lead_somewhere():
    bad = [p for rel in ["README.md", *doc_pages()] for p in link_problems(os.path.join(ROOT, rel), read(rel))]
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def test_link_problems_catch_missing_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `--compile` flag (kept)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    text = ("# Page\n\n[ok](other.md) [ok](other.md#the---compile-flag-kept) [ok](other.md#twice-1) [ok](#page) "
            "[web](https://example.com/x.md) ![image](nowhere.png) `[code](nowhere.md)`\n\n"
            "```\n[fenced](nowhere.md)\n```\n\n"
            "[gone](missing.md) [bad anchor](other.md#nothing) [bad here](#nothing) [twice](other.md#twice-2)\n")
    page.write_text(text)
    rel = os.path.relpath(str(page), ROOT)
    assert link_problems(str(page), text) == [
        f"  {rel}: missing.md: no such file",
        f"  {rel}: other.md#nothing: no heading with that anchor",
        f"  {rel}: #nothing: no heading with that anchor",
        f"  {rel}: other.md#twice-2: no heading with that anchor",
    ]


# ---- design.md names code that exists ---------------------------------------------------------
@functools.cache
def defined_names() -> frozenset[str]:
    """Names specbuild/ defines or uses as keys: packages, modules, classes, functions, arguments,
    assigned names and attributes, dataclass fields, keyword arguments and identifier-like string
    constants (JSON keys such as a bundle's `shares`), and Python's builtins and keywords."""
    names: set[str] = set(dir(builtins)) | set(keyword.kwlist)
    names.update(os.path.basename(d) for d, _, _ in os.walk(PKG))  # packages: `engine`, `backends`
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        names.add(os.path.basename(path)[:-3])
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
    return frozenset(names)


@functools.cache
def source_text() -> str:
    parts = []
    for path in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n".join(parts)


def code_spans(text: str) -> list[str]:
    """`spans` of prose, fenced blocks skipped."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose)


IDENT = r"[A-Za-z_]\w*"
CALL = re.compile(rf"^({IDENT}(?:\.{IDENT})*)(?:\(.*\))?(?:\s*->\s*({IDENT}))?$")  # name, name(args), f(x) -> T


def name_problem(span: str) -> str | None:
    """Why a code span of design.md names nothing in the tree (None: it does, or it is not a name:
    a command line, an expression, a shape comment)."""
    span = span.strip()
    if span.startswith("--"):
        return None if re.search(rf"['\"]{re.escape(span.split()[0])}['\"/ ]", source_text()) else "no such option"
    if span.startswith("/"):  # an HTTP route
        return None if re.search(rf"['\"]{re.escape(span)}['\"]", source_text()) else "no such route"
    if "/" in span and " " not in span:
        rel = span.rstrip("/")
        candidates = [rel] if rel.split("/")[0] in ROOTS else [os.path.join("specbuild", rel)]
        if span.endswith("*") or "*" in rel:
            return None if any(glob.glob(os.path.join(ROOT, c)) for c in candidates) else "matches no file"
        return None if any(os.path.exists(os.path.join(ROOT, c)) for c in candidates) else "no such file or folder"
    if span.endswith("*") and re.fullmatch(r"\w+\*", span):  # files named `prefix*`
        return None if glob.glob(os.path.join(PKG, "**", span + ".py"), recursive=True) else "matches no file"
    m = CALL.match(span)
    if not m:
        return None  # not a name: commands, shapes, settings
    missing = [p for p in m.group(1).split(".") + ([m.group(2)] if m.group(2) else []) if p not in defined_names()]
    return f"{', '.join(missing)} not found in specbuild/" if missing else None


def test_name_problem_rules():
    assert name_problem("engine/scheduler.py") is None
    assert name_problem("speculation/proposers/registry.py") is None
    assert name_problem("tests/test_layers.py") is None
    assert name_problem("engine/nothing.py") == "no such file or folder"
    assert name_problem("Speculator.settle") is None
    assert name_problem("rollback(seq, length)") is None
    assert name_problem("submit(request) -> handle") is None
    assert name_problem("Speculator.nothing_of_the_kind") == "nothing_of_the_kind not found in specbuild/"
    assert name_problem("--parallel-draft") is None
    assert name_problem("--no-such-option") == "no such option"
    assert name_problem("/health") is None and name_problem("/nowhere") == "no such route"
    assert name_problem("ValueError") is None and name_problem("engine") is None
    assert name_problem("# [batch, k + 1, vocab]") is None
    assert name_problem("engine/no_such_*.py") == "matches no file"
    assert name_problem("no_such_prefix*") == "matches no file"
    assert code_spans("a `Engine` b\n```\n`Fenced`\n```\nc `--compile`") == ["Engine", "--compile"]


def test_design_names_only_code_that_exists():
    spans = code_spans(read(os.path.join("docs", "design.md")))
    assert len(spans) > 50  # the page cites the code it describes
    bad = [f"  `{s}`: {why}" for s in spans if (why := name_problem(s))]
    assert not bad, "docs/design.md names code that is not in the tree:\n" + "\n".join(bad)
