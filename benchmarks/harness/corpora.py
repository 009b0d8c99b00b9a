"""The haystacks' texts (:data:`HAYSTACKS`): Python's pydoc topics, stdlib docstrings and shipped license files,
built offline from what is installed; the two added corpora keep prose paragraphs without an answer word of the
benchmarks (:data:`ANSWER_WORDS`) or a number of five or more digits. ``haystack`` re-exports every public name."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable

@functools.lru_cache(maxsize=1)
def pydoc_corpus() -> str:
    """Python's ``pydoc_data.topics.topics`` joined by blank lines in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip("\n") for k in sorted(topics))


# ------------------------------------------------------------ more haystacks
# Every word a benchmark may expect as an answer (bench_needle's cities; bench_multiturn's names, favourites,
# days and cities). The added corpora drop each paragraph containing one of them (whole word, any case, plural
# s/es allowed) or a number of 5+ digits (needle passkeys), so a correct answer can only come from the needle.
ANSWER_WORDS = (
    "Lisbon", "Oslo", "Nairobi", "Montevideo", "Reykjavik", "Kyoto", "Antwerp", "Cusco",
    "Tobias", "Ingrid", "Ravi", "Elena", "Kofi", "Hana", "Lucas", "Amara",
    "purple", "turquoise", "crimson", "amber", "otter", "giraffe", "badger", "walrus",
    "cello", "trumpet", "harp", "banjo",
    "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
)
_ANSWER_RE = re.compile(r"(?<![a-z0-9])(?:" + "|".join(w.lower() for w in ANSWER_WORDS) + r")(?:e?s)?(?![a-z0-9])")
_LONG_NUMBER_RE = re.compile(r"(?<!\d)\d{5,}(?!\d)")

# Pure-Python standard-library modules (no C accelerator whose docstrings would differ, no platform-only classes
# worth speaking of), sorted. Their docstrings change only between Python minor versions.
STDLIB_DOC_MODULES = (
    "argparse", "configparser", "contextlib", "dataclasses", "difflib", "email.message", "enum", "fileinput",
    "fractions", "ftplib", "getopt", "gettext", "glob", "graphlib", "gzip", "http.client", "http.cookiejar",
    "http.server", "imaplib", "inspect", "ipaddress", "logging", "logging.handlers", "mailbox", "mimetypes",
    "optparse", "pathlib", "pdb", "pkgutil", "plistlib", "poplib", "pprint", "queue", "sched", "shelve", "shlex",
    "shutil", "smtplib", "socketserver", "string", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "typing", "unittest.case", "unittest.mock", "urllib.parse", "urllib.request",
    "uuid", "warnings", "weakref", "zipfile",
)

# Distributions whose .dist-info license files make the ``licenses`` haystack, in this order. All are installed
# by ``make install`` (torch pinned; hypothesis through the test extra); none bundles platform-specific libraries'
# licenses (numpy's, pillow's and jaxlib's do, so they are left out).
LICENSE_DISTRIBUTIONS = ("hypothesis", "jax", "matplotlib", "torch", "typing_extensions")
_LICENSE_FILE = re.compile(r"(^|/)(LICEN[CS]E|COPYING|NOTICE)[^/]*$", re.I)


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, lines stripped (``\r\n`` folded)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def is_prose(paragraph: str) -> bool:
    """Whether a paragraph reads as English prose: at least 8 words, mostly letters, ends a sentence (not a
    colon introducing code or a list that is left out), no doctest, URL, e-mail address or copyright line, and
    no answer word or long number."""
    text = " ".join(paragraph.split())
    if len(text.split()) < 8 or ">>>" in text or "://" in text or "www." in text or "@" in text:
        return False
    if sum(c.isalpha() or c == " " for c in text) < 0.85 * len(text):
        return False
    if not re.search(r"[.!?][\"')]?$", text) or re.match(r"(\(c\)|©)?\s*copyright\b", text, re.I):
        return False
    return not (_ANSWER_RE.search(text.lower()) or _LONG_NUMBER_RE.search(text))


def _prose_corpus(paragraphs, *, unindented: bool = False) -> str:
    """The prose paragraphs (each once, whitespace collapsed) joined by blank lines, in order."""
    seen, out = set(), []
    for p in paragraphs:
        if unindented and any(line[:1] in (" ", "\t") for line in p.split("\n")):
            continue  # indented: code, a table or a list continuation
        flat = " ".join(p.split())
        if flat.lower() in seen or not is_prose(p):
            continue
        seen.add(flat.lower())
        out.append(flat)
    return "\n\n".join(out)


def _stdlib_docstrings(module_name: str) -> list[str]:
    """The module's docstring, then those of its public classes (each followed by its public methods') and
    functions defined in it, in sorted name order."""
    import importlib
    import inspect

    mod = importlib.import_module(module_name)
    docs = [inspect.getdoc(mod) or ""]
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isclass(obj):
            docs.append(inspect.getdoc(obj) or "")
            docs += [inspect.getdoc(m) or "" for n, m in sorted(vars(obj).items())
                     if not n.startswith("_") and inspect.isfunction(m)]
        elif inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj) or "")
    return docs


@functools.lru_cache(maxsize=1)
def stdlib_docs_corpus() -> str:
    """Prose paragraphs of the docstrings of :data:`STDLIB_DOC_MODULES` (module, then its public API)."""
    import warnings

    with warnings.catch_warnings():  # deprecated names (typing.io, typing.re) warn when their __doc__ is read
        warnings.simplefilter("ignore", DeprecationWarning)
        paragraphs = [p for m in STDLIB_DOC_MODULES for d in _stdlib_docstrings(m) for p in _paragraphs(d)]
    return _prose_corpus(paragraphs, unindented=True)


def _license_files(dist_name: str):
    """(distribution, sorted license file paths in its .dist-info) of an installed distribution."""
    from importlib import metadata

    dist = metadata.distribution(dist_name)
    files = sorted(str(f) for f in (dist.files or []) if ".dist-info" in str(f) and _LICENSE_FILE.search(str(f)))
    return dist, files


@functools.lru_cache(maxsize=1)
def licenses_corpus() -> str:
    """Prose paragraphs of the license files in the .dist-info of :data:`LICENSE_DISTRIBUTIONS`."""
    paragraphs = []
    for name in LICENSE_DISTRIBUTIONS:
        dist, files = _license_files(name)
        for f in files:
            paragraphs += _paragraphs(dist.locate_file(f).read_text(encoding="utf-8", errors="replace"))
    return _prose_corpus(paragraphs)


@dataclasses.dataclass(frozen=True)
class Haystack:
    name: str
    source: str  # what the text is, for the results
    corpus: Callable[[], str]


HAYSTACKS = {
    "pydoc": Haystack("pydoc", "pydoc_data.topics.topics (Python's language reference topics), sorted keys "
                               "joined by blank lines", pydoc_corpus),
    "stdlib-docs": Haystack("stdlib-docs", f"docstrings (inspect.getdoc) of {len(STDLIB_DOC_MODULES)} pure-Python "
                                           "stdlib modules and their public classes, methods and functions, prose "
                                           "paragraphs only", stdlib_docs_corpus),
    "licenses": Haystack("licenses", "license files in the .dist-info of " + ", ".join(LICENSE_DISTRIBUTIONS)
                                     + ", prose paragraphs only, each once", licenses_corpus),
}
DEFAULT_HAYSTACK = "pydoc"


def haystack_corpus(name: str) -> str:
    """The full text of haystack ``name`` (one of :data:`HAYSTACKS`)."""
    try:
        return HAYSTACKS[name].corpus()
    except KeyError:
        raise ValueError(f"unknown haystack {name!r}; known: {', '.join(HAYSTACKS)}") from None


def haystack_info(name: str, tokenizer=None) -> dict:
    """What haystack ``name`` is, for the results: source, versions it depends on, characters, SHA-256 of the
    text (and its length in ``tokenizer``'s tokens when one is given)."""
    import hashlib
    import platform

    text = haystack_corpus(name)
    info = {"name": name, "source": HAYSTACKS[name].source, "python": platform.python_version(),
            "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    if name == "stdlib-docs":
        info["modules"] = list(STDLIB_DOC_MODULES)
    if name == "licenses":
        info["distributions"] = {}
        for d in LICENSE_DISTRIBUTIONS:
            dist, files = _license_files(d)
            info["distributions"][d] = {"version": dist.version, "files": len(files)}
    if tokenizer is not None:
        info["tokens"] = len(tokenizer.encode(text, add_special_tokens=False))
    return info
