#!/usr/bin/env python3
"""References that must resolve inside the repository (no build; CI runs it first, .ci/run).

The project's contract is docs/design.md and its house style docs/contributing.md; the
documents they were first written from lived outside the repository. This check fails
(exit 1, one line per finding, as path:line) when

  * any file of the repository cites a section of the old spec by number, or points into
    the shared folder beside the repository, or names the old spec or style file;
  * a citation of the form  docs/design.md "Section"  (several sections may follow one
    another: docs/design.md "Identity", "Tiers") names a heading that docs/design.md does
    not have. A citation may wrap over comment lines (// or #): prefixes are joined away.

The files are the repository's tracked and untracked-but-not-ignored ones (git ls-files), so
build trees and .git are never read; outside a git checkout every file under the root but
build*/ and .git/ is. Binary files are skipped.

    tests/static/check_references.py [ROOT]
"""

import os
import re
import subprocess
import sys

FORBIDDEN = [
    (re.compile(r"SPEC\s*§"),
     'a numbered section of the old spec: cite a section of docs/design.md by its name'),
    (re.compile(r"\.\./shared\b"), "a path outside the repository (../shared)"),
    (re.compile(r"\bshared/(SPEC|STYLE|DEVICE)\.md"), "a document outside the repository"),
    (re.compile(r"\b(SPEC|STYLE)\.md\b"),
     "the old spec or style file: docs/design.md or docs/contributing.md"),
]

DESIGN = "docs/design.md"
# docs/design.md followed by one or more quoted section names.
CITATION = re.compile(r'docs/design\.md((?:\s*(?:,|;|and|or)?\s*"[^"\n]+")+)')
QUOTED = re.compile(r'"([^"\n]+)"')
# A line break plus the comment prefix of the next line: // and # (C++, CMake, Python,
# shell), * (block comments).
WRAP = re.compile(r"[ \t]*\n[ \t]*(?://+|#+|\*)?[ \t]*")


def repo_files(root):
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True).stdout
        return sorted({f for f in out.decode().split("\0") if f})
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, subdirs, names in os.walk(root):
            subdirs[:] = [s for s in subdirs if s != ".git" and not s.startswith("build")]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
        return sorted(files)


def read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:  # a deleted file git still lists, a dangling link
        return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def headings(text):
    """The heading texts of a Markdown document, outside fenced code blocks."""
    names, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            m = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)
            if m:
                names.add(m.group(1))
    return names


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), "..", ".."))
    design = read_text(os.path.join(root, DESIGN))
    if design is None:
        print(f"check_references: {DESIGN} is missing", file=sys.stderr)
        return 1
    sections = headings(design)
    me = os.path.relpath(os.path.abspath(__file__), root)
    findings, citations = [], 0
    for rel in repo_files(root):
        text = read_text(os.path.join(root, rel))
        if text is None or rel == me:  # this file spells out what it looks for
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for pattern, why in FORBIDDEN:
                if pattern.search(line):
                    findings.append(f"{rel}:{n}: {why}: {line.strip()}")
        if DESIGN not in text:
            continue
        # Join wrapped comment lines, keeping a map back to the original line numbers.
        joined, starts, pos, length = [], [], 0, 0
        for m in WRAP.finditer(text):
            joined.append(text[pos:m.start()])
            length += m.start() - pos
            starts.append((length, m.end()))  # (offset in flat of the " ", offset in text after)
            joined.append(" ")
            length += 1
            pos = m.end()
        joined.append(text[pos:])
        flat = "".join(joined)
        for m in CITATION.finditer(flat):
            for name in QUOTED.findall(m.group(1)):
                citations += 1
                if name not in sections:
                    # The original offset: the last join at or before the match.
                    orig = m.start()
                    for flat_at, text_at in starts:
                        if flat_at < m.start():
                            orig = text_at + (m.start() - flat_at - 1)
                    findings.append(f"{rel}:{line_of(text, orig)}: cites {DESIGN} \"{name}\", "
                                    f"which is no heading of {DESIGN}")
    for f in findings:
        print(f)
    if findings:
        print(f"check_references: {len(findings)} finding(s)", file=sys.stderr)
        return 1
    print(f"check_references: ok ({citations} citations of {DESIGN}, {len(sections)} sections)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
