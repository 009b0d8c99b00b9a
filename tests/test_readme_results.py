"""README.md's numbers against benchmarks/RESULTS.md, and README's relative links.

What "a number comes from the section it cites" means here:

- A section is the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in RESULTS.md; README cites it
  as ``§name`` (outside code spans). Citing a name RESULTS.md does not have fails.
- A number is a token of ``NUMBER``: digits with optional thousands groups (``1,000``) and decimals, or a fraction
  of two of them (``21/27`` is one token), not glued to a word (``P99``, ``bf16`` and ``H100`` are names, not
  numbers). A README number matches a section when the same string is a token of the section's text: ``0.0073``
  is not ``0.007`` and ``1,000`` is not ``1000``.
- Not checked: fenced code blocks, code spans (options, defaults, formulas: ``window=32``, ``N_full / N``),
  citations and link targets.
- A table cell may use the sections its column's header cell cites (or, where that header cites none, every
  section the header row cites) and the sections its own row cites; every number in it must match one of them.
  A table row holding a number with no section to match it against fails, except in the tables listed in
  ``NON_RESULT_TABLES`` (no measurement in them).
- A paragraph or list item that cites sections has each of its numbers matched against those sections.

This proves that each number exists in the section it cites, not that it is the cell it should be.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

# README tables without measurements, by their first header cell, and why.
NON_RESULT_TABLES = {
    "HF `architectures`": "model families and their versions",
    "script": "what each benchmark script measures",
}

_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# not after a letter, digit, '_' or '.', except the 'x' of a ratio written x1.21 (after a non-letter)
NUMBER = re.compile(rf"(?<![A-Za-wyz0-9_.])(?<![A-Za-z]x)(?:{_NUM})(?:/(?:{_NUM}))?(?![0-9])")
CITATION = re.compile(r"§([A-Za-z0-9](?:[A-Za-z0-9_-]*[A-Za-z0-9])?)")
SECTION = re.compile(r"<!-- BEGIN (\S+) -->\n(.*?)<!-- END \1 -->", re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def results_sections(results_text: str) -> dict[str, set[str]]:
    """Section name -> the set of number tokens in its text (code included)."""
    out = {}
    for name, body in SECTION.findall(results_text):
        assert name not in out, f"RESULTS.md has two sections named {name!r}"
        out[name] = set(NUMBER.findall(body))
    return out


def _no_code(text: str) -> str:
    return CODE_SPAN.sub(" ", text)


def citations(text: str) -> list[str]:
    """Section names cited in ``text`` outside code spans."""
    return CITATION.findall(_no_code(text))


def numbers(text: str) -> list[str]:
    """Number tokens a reader sees in ``text``: not in code spans, citations, link targets or images."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", text)
    text = LINK.sub(lambda m: m.group(1), text)
    text = CITATION.sub(" ", _no_code(text))
    text = re.sub(r"<!--.*?-->", " ", text)
    return NUMBER.findall(text)


def _cells(line: str) -> list[str]:
    """A table row's cells, splitting on '|' outside code spans."""
    cells, cur, in_code = [], "", False
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    for i, ch in enumerate(body):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code and (i == 0 or body[i - 1] != "\\"):
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
    cells.append(cur.strip())
    return cells


def blocks(markdown: str):
    """Yield ('table', [lines]) and ('prose', text) blocks outside fenced code; headings are skipped."""
    lines, i, in_fence = markdown.splitlines(), 0, False
    prose: list[str] = []

    def flush():
        if prose:
            yield "prose", "\n".join(prose)
            prose.clear()

    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            yield from flush()
            in_fence = not in_fence
            i += 1
            continue
        if in_fence:
            i += 1
            continue
        if line.lstrip().startswith("|"):
            yield from flush()
            table = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                table.append(lines[i])
                i += 1
            yield "table", table
            continue
        if not line.strip() or line.startswith("#"):
            yield from flush()
        elif re.match(r"\s*([-*+]|\d+\.)\s", line):
            yield from flush()
            prose.append(line)
        else:
            prose.append(line)
        i += 1
    yield from flush()


def _check_numbers(where: str, text: str, allowed: list[str], sections: dict[str, set[str]]) -> list[str]:
    found = numbers(text)
    if not found:
        return []
    if not allowed:
        return [f"{where}: numbers {found} cite no RESULTS section"]
    known = [s for s in allowed if s in sections]
    pool = set().union(*(sections[s] for s in known)) if known else set()
    return [f"{where}: {n!r} is in none of the cited sections {known}" for n in found if n not in pool]


def check_readme(readme_text: str, results_text: str) -> list[str]:
    """Every problem found: unknown citations, numbers not in their cited sections, uncited table numbers."""
    sections = results_sections(results_text)
    problems = []
    for name in citations(re.sub(r"(?ms)^\s*```.*?^\s*```", " ", readme_text)):
        if name not in sections:
            problems.append(f"§{name} is not a section of benchmarks/RESULTS.md")
    for kind, block in blocks(readme_text):
        if kind == "prose":
            cited = citations(block)
            if cited:
                problems += _check_numbers(f"paragraph {block[:60]!r}", block, cited, sections)
            continue
        header = _cells(block[0])
        if header and header[0] in NON_RESULT_TABLES:
            continue
        header_cites = [citations(c) for c in header]
        table_cites = [s for c in header_cites for s in c]
        rows = [r for r in block[1:] if not re.fullmatch(r"\s*\|?[\s:|-]+\|?\s*", r)]
        for row in rows:
            cells = _cells(row)
            row_cites = [s for c in cells for s in citations(c)]
            for j, cell in enumerate(cells):
                col = header_cites[j] if j < len(header_cites) and header_cites[j] else table_cites
                where = f"table row {row[:50]!r}, column {header[j] if j < len(header) else j!r}"
                problems += _check_numbers(where, cell, col + row_cites, sections)
    return problems


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = LINK.sub(lambda m: m.group(1), heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor a markdown file defines: its headings' (GitHub numbering repeats) and <a id/name>."""
    out, seen, in_fence = set(), {}, False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            base = _slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", markdown))
    return out


def check_links(path: Path, root: Path = ROOT) -> list[str]:
    """Relative links and images of a markdown file whose file or anchor does not exist."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"(?ms)^\s*(```|~~~).*?^\s*\1", " ", text)
    problems = []
    for _, target in LINK.findall(_no_code(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.relative_to(root)}: link {target!r}: {file_part} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            where = file_part or path.name
            problems.append(f"{path.relative_to(root)}: link {target!r}: no heading #{anchor} in {where}")
    return problems


# ------------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def texts():
    return README.read_text(encoding="utf-8"), RESULTS.read_text(encoding="utf-8")


def test_readme_numbers_are_in_the_results_sections_they_cite(texts):
    readme, results = texts
    assert check_readme(readme, results) == []


def test_readme_tables_cite_sections(texts):
    """The check above is not vacuous: README has cited results tables and they hold numbers."""
    readme, results = texts
    sections = results_sections(results)
    checked = [b for k, b in blocks(readme) if k == "table" and citations("\n".join(b))]
    assert len(checked) >= 5
    assert sum(len(numbers("\n".join(b[2:]))) for b in checked) >= 100
    assert {"needle-issue15", "multiturn-issue15", "latency-full", "mesh"} <= set(citations(readme)) <= set(sections)


def test_a_stale_number_fails(texts):
    readme, results = texts
    row = "| HeteroCache | 0.3 | 33/36 | 59/72 | 35/54 | 10/27 |"
    assert row in readme
    sections = results_sections(results)
    assert "58/72" not in sections["needle-issue15-heldout"]  # the held-out count README used to print
    problems = check_readme(readme.replace(row, row.replace("59/72", "58/72")), results)
    assert len(problems) == 1 and "'58/72'" in problems[0] and "needle-issue15-heldout" in problems[0]


def test_the_same_decimal_string_is_required():
    results = "<!-- BEGIN fid -->\n| heterocache | 0.990 | 0.0073 | 1,000 tok |\n<!-- END fid -->\n"
    table = "| policy | top-1 / KL | tokens | RESULTS |\n| :-- | --: | --: | :-- |\n| HeteroCache | {} | {} | §fid |\n"
    assert check_readme(table.format("0.990 / 0.0073", "1,000"), results) == []
    assert len(check_readme(table.format("0.99 / 0.0073", "1,000"), results)) == 1
    assert len(check_readme(table.format("0.990 / 0.007", "1000"), results)) == 2


def test_a_column_is_held_to_its_own_section():
    results = ("<!-- BEGIN a -->\nneedle 13/36\n<!-- END a -->\n"
               "<!-- BEGIN b -->\nfacts 21/27\n<!-- END b -->\n")
    table = "| policy | needle §a | facts §b |\n| :-- | --: | --: |\n| SnapKV | {} | {} |\n"
    assert check_readme(table.format("13/36", "21/27"), results) == []
    assert check_readme(table.format("21/27", "13/36"), results) == [
        "table row '| SnapKV | 21/27 | 13/36 |', column 'needle §a': '21/27' is in none of the cited sections ['a']",
        "table row '| SnapKV | 21/27 | 13/36 |', column 'facts §b': '13/36' is in none of the cited sections ['b']",
    ]


def test_a_citation_of_a_missing_section_fails(texts):
    readme, results = texts
    problems = check_readme(readme.replace("§needle-issue15-heldout", "§needle-issue15-held-out"), results)
    assert "§needle-issue15-held-out is not a section of benchmarks/RESULTS.md" in problems
    assert any("'59/72' is in none of the cited sections" in p for p in problems)


def test_uncited_numbers_fail_and_code_spans_are_not_numbers():
    results = "<!-- BEGIN a -->\nx\n<!-- END a -->\n"
    assert check_readme("| policy | decode |\n| :-- | --: |\n| SnapKV | 0.78 |\n", results) == [
        "table row '| SnapKV | 0.78 |', column 'decode': numbers ['0.78'] cite no RESULTS section"]
    assert check_readme("| policy | smallest rho |\n| :-- | :-- |\n| `snapkv` | `window / 32` |\n", results) == []
    assert check_readme("SnapKV at rho 0.3 recalls 2/27 (§a).\n\nNo citation: 0.3.\n", results) == [
        "paragraph 'SnapKV at rho 0.3 recalls 2/27 (§a).': '0.3' is in none of the cited sections ['a']",
        "paragraph 'SnapKV at rho 0.3 recalls 2/27 (§a).': '2/27' is in none of the cited sections ['a']",
    ]


def test_number_tokens():
    assert numbers("P99/P50 1.44, bf16 on an H100, 21/27 and 4/27 / 2/27, 1,136.0 MiB, x1.21, -0.0001") == [
        "1.44", "21/27", "4/27", "2/27", "1,136.0", "1.21", "0.0001"]
    assert numbers("`budget=0.3` §latency-issue17 [a 2K link](docs/x2.md#y-3) ![img 5](a/6.png)") == ["2"]


@pytest.mark.parametrize("name", ["README.md", "docs/errors.md", "docs/policies.md", "docs/performance-notes.md",
                                  "docs/offload.md", "docs/devices.md", "docs/architecture.md"])
def test_relative_links_resolve(name):
    assert check_links(ROOT / name) == []


def test_a_broken_link_or_anchor_fails(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Sessions: the per-turn re-selection\n\n## A\n")
    md = tmp_path / "README.md"
    md.write_text("[ok](docs/a.md#sessions-the-per-turn-re-selection) [ok](docs/a.md#a-1) [ok](#top)\n"
                  "[gone](docs/b.md) [no anchor](docs/a.md#sessions) `[in code](docs/c.md)` [web](https://x.org/y)\n"
                  "\n# Top\n")
    assert check_links(md, tmp_path) == [
        "README.md: link 'docs/b.md': docs/b.md does not exist",
        "README.md: link 'docs/a.md#sessions': no heading #sessions in docs/a.md",
    ]
