#!/usr/bin/env python3
"""Extract the demo model's training text from Debian's python3.11-doc package.

Source: the reStructuredText sources of the Python 3.11 documentation, which Sphinx
ships inside the HTML build (``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``).
Licence: the Python documentation is distributed under the PSF License Version 2
(see ``license.rst.txt`` in the same tree and ``/usr/share/doc/python3.11-doc/copyright``);
code examples in it are additionally under the Zero-Clause BSD licence.

Each ``.rst.txt`` file is one document. Markup is lightly stripped to readable prose
(roles, labels, heading underlines, directive options, table borders), code blocks are kept.
Documents are sorted by path; every 20th document (index % 20 == 19) is held out for
validation, the rest is training data. Documents are joined with ``<|endoftext|>`` lines.

Usage:
    python scripts/demo_data.py                # finds the package or downloads the .deb via apt
    python scripts/demo_data.py --src DIR      # DIR = an html/_sources directory
    python scripts/demo_data.py --check        # verify data/ against the recorded checksums

The committed files in data/ are the reference; data/manifest.json records their sha256 so a
re-run can confirm that it reproduced them (a newer Debian revision of the package may differ).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

PACKAGE = "python3.11-doc"
INSTALLED_SOURCES = "/usr/share/doc/python3.11/html/_sources"
DOC_SEP = "<|endoftext|>"
HOLDOUT_EVERY = 20  # document i goes to validation when i % 20 == 19

# Skipped: navigation/legal pages that are not documentation prose.
SKIP_FILES = {"contents.rst.txt", "license.rst.txt", "copyright.rst.txt", "bugs.rst.txt", "about.rst.txt"}
SKIP_DIRS = {"includes"}

# Directives that produce no text of their own (their indented body, if any, is dropped too).
DROP_DIRECTIVES = {
    "index",
    "highlight",
    "toctree",
    "module",
    "sectionauthor",
    "moduleauthor",
    "testsetup",
    "testcleanup",
    "include",
    "literalinclude",
    "only",
    "raw",
    "image",
    "figure",
    "tabularcolumns",
    "contents",
    "currentmodule",
    "program",
    "audit-event",
    "impl-detail-x",
    "availability",
    "c:namespace",
    "default-role",
    "role",
    "productionlist",
    "grammar-snippet",
    "literal-block-x",
    "rst-class",
    "csv-table",
    "c:macro-x",
    "limited-api-list",
    "toctree-x",
}
# Directives rendered with a fixed lead-in by Sphinx.
LEAD_INS = {
    "note": "Note:",
    "warning": "Warning:",
    "seealso": "See also:",
    "important": "Important:",
    "caution": "Caution:",
    "tip": "Tip:",
    "hint": "Hint:",
    "attention": "Attention:",
    "danger": "Danger:",
    "impl-detail": "CPython implementation detail:",
}

ROLE_RE = re.compile(r":(?:[\w-]+:)?([\w-]+):`([^`]+)`")
LINK_RE = re.compile(r"`([^`<]+?)\s*<[^>]+>`__?")
REF_RE = re.compile(r"`([^`]+)`__?")
LITERAL_RE = re.compile(r"``(.+?)``")
STRONG_RE = re.compile(r"\*\*(\S[^*\n]*?)\*\*")
EMPH_RE = re.compile(r"(?<![\w*\\])\*(\S[^*\n]*?\S|\S)\*(?![\w*])")
UNDERLINE_RE = re.compile(r"^\s*([=\-~^\"'`#*+_.:])\1{2,}\s*$")
TABLE_BORDER_RE = re.compile(r"^\s*\+[-=+]+\+\s*$")
SIMPLE_TABLE_RE = re.compile(r"^\s*=+( +=+)+\s*$")
DIRECTIVE_RE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
OPTION_RE = re.compile(r"^\s+:[\w-]+:(\s.*)?$")


def _role(m: re.Match) -> str:
    role, text = m.group(1), m.group(2)
    lt = text.find("<")
    if lt > 0 and text.endswith(">"):
        text = text[:lt].rstrip()
    else:
        text = text.lstrip("!")
        if text.startswith("~"):
            text = text[1:].split(".")[-1]
    if role in ("func", "meth") and not text.endswith(")"):
        text += "()"
    return text


def inline(line: str) -> str:
    line = ROLE_RE.sub(_role, line)
    line = LITERAL_RE.sub(r"\1", line)
    line = LINK_RE.sub(r"\1", line)
    line = REF_RE.sub(r"\1", line)
    line = STRONG_RE.sub(r"\1", line)
    line = EMPH_RE.sub(r"\1", line)
    line = line.replace("\\ ", "")
    return line


def clean_rst(text: str) -> str:
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    drop_indent = None  # when set, drop lines indented deeper than this (body of a dropped block)
    while i < len(lines):
        line = lines[i].rstrip()
        i += 1
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if drop_indent is not None:
            if stripped == "" or indent > drop_indent:
                continue
            drop_indent = None
        if stripped == "":
            out.append("")
            continue
        m = DIRECTIVE_RE.match(line)
        if m:
            name, arg = m.group(2), m.group(3).strip()
            # skip option lines that follow a directive
            while i < len(lines) and OPTION_RE.match(lines[i]):
                i += 1
            if name in DROP_DIRECTIVES:
                drop_indent = indent
                continue
            if name in LEAD_INS:
                out.append(" " * indent + LEAD_INS[name] + ((" " + inline(arg)) if arg else ""))
            elif name == "versionadded":
                out.append(" " * indent + f"New in version {arg}.")
            elif name == "versionchanged":
                out.append(" " * indent + f"Changed in version {arg}:")
            elif name == "deprecated":
                out.append(" " * indent + f"Deprecated since version {arg}:")
            elif name in ("code-block", "sourcecode", "code", "doctest", "testcode", "testoutput"):
                pass  # the indented body (the code) is kept as is
            elif arg:
                out.append(" " * indent + inline(arg))
            continue
        if stripped.startswith(".. _") or stripped.startswith(".. |") or stripped == "..":
            # label, substitution definition or empty comment
            if stripped == "..":
                drop_indent = indent
            continue
        if stripped.startswith(".. ") and "::" not in stripped:
            # comment: drop it and its indented continuation
            drop_indent = indent
            continue
        if UNDERLINE_RE.match(line) or TABLE_BORDER_RE.match(line) or SIMPLE_TABLE_RE.match(line):
            continue
        if stripped == "::":
            continue
        if line.endswith("::"):
            line = line[:-1]
        out.append(inline(line))
    # collapse runs of blank lines
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n"


def find_sources(src: str | None) -> tuple[str, str]:
    """Return (sources_dir, description). Downloads the .deb with apt if not installed."""
    if src:
        return src, f"--src {src}"
    if os.path.isdir(INSTALLED_SOURCES):
        ver = subprocess.run(["dpkg-query", "-W", "-f=${Version}", PACKAGE], capture_output=True, text=True).stdout
        return INSTALLED_SOURCES, f"{PACKAGE} {ver} (installed)"
    tmp = tempfile.mkdtemp(prefix="edge0-demo-data-")
    subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True)
    deb = glob.glob(os.path.join(tmp, f"{PACKAGE}_*.deb"))[0]
    subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "x")], check=True)
    return os.path.join(tmp, "x", INSTALLED_SOURCES.lstrip("/")), f"{os.path.basename(deb)} (sha256 {sha256(deb)})"


def list_docs(src: str) -> list[str]:
    paths = []
    for root, dirs, files in os.walk(src):
        rel_root = os.path.relpath(root, src)
        if rel_root.split(os.sep)[0] in SKIP_DIRS:
            continue
        for f in files:
            if f.endswith(".rst.txt") and not (rel_root == "." and f in SKIP_FILES):
                paths.append(os.path.normpath(os.path.join(rel_root, f)))
    return sorted(paths)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read())
    return h.hexdigest()


def extract(src: str, out_dir: str) -> dict:
    docs = list_docs(src)
    train, valid = [], []
    train_names, valid_names = [], []
    for idx, rel in enumerate(docs):
        with open(os.path.join(src, rel), encoding="utf-8") as fh:
            text = clean_rst(fh.read())
        if len(text.strip()) < 200:
            continue
        if idx % HOLDOUT_EVERY == HOLDOUT_EVERY - 1:
            valid.append(text)
            valid_names.append(rel)
        else:
            train.append(text)
            train_names.append(rel)
    os.makedirs(out_dir, exist_ok=True)
    sep = "\n" + DOC_SEP + "\n"
    files = {}
    for name, parts in (("train.txt", train), ("valid.txt", valid)):
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(sep.join(parts))
        os.replace(path + ".tmp", path)
        files[name] = {
            "sha256": sha256(path),
            "bytes": os.path.getsize(path),
            "documents": len(parts),
            "words": sum(len(p.split()) for p in parts),
        }
    manifest = {
        "files": files,
        "train_documents": train_names,
        "valid_documents": valid_names,
        "split": f"documents sorted by path; document i is validation when i % {HOLDOUT_EVERY} == {HOLDOUT_EVERY - 1}",
        "document_separator": DOC_SEP,
    }
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", help="html/_sources directory of the Python docs")
    ap.add_argument("--out", default="data", help="output directory (default: data)")
    ap.add_argument("--check", action="store_true", help="only verify checksums of existing files")
    args = ap.parse_args()
    manifest_path = os.path.join(args.out, "manifest.json")
    if args.check:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
        ok = True
        for name, info in manifest["files"].items():
            got = sha256(os.path.join(args.out, name))
            print(f"{name}: {'ok' if got == info['sha256'] else 'MISMATCH'}")
            ok &= got == info["sha256"]
        sys.exit(0 if ok else 1)
    src, desc = find_sources(args.src)
    tmp_dir = src[: src.index("/x/")] if "/edge0-demo-data-" in src else None
    old = None
    if os.path.exists(manifest_path):
        with open(manifest_path) as fh:
            old = json.load(fh)
    manifest = extract(src, args.out)
    # the PSF licence asks that its text and copyright notice be retained with derived works
    lic_src = os.path.join(src, "license.rst.txt")
    with (
        open(lic_src, encoding="utf-8") as fh,
        open(os.path.join(args.out, "LICENSE-python-docs.txt"), "w", encoding="utf-8") as out,
    ):
        out.write(
            "The text in train.txt and valid.txt is derived from the Python 3.11 documentation\n"
            "(Debian package python3.11-doc), Copyright (c) 2001-2023 Python Software Foundation.\n"
            "It is distributed under the PSF License Version 2 reproduced below (license.rst from\n"
            "the same documentation, unmodified).\n\n"
        )
        out.write(fh.read())
    if tmp_dir:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    manifest["source"] = {
        "debian_package": PACKAGE,
        "extracted_from": desc,
        "path": INSTALLED_SOURCES + "/**/*.rst.txt",
        "licence": "PSF License Version 2 (Python documentation); code examples also 0BSD",
        "skipped": sorted(SKIP_FILES) + [d + "/" for d in sorted(SKIP_DIRS)],
    }
    with open(manifest_path + ".tmp", "w") as fh:
        json.dump(manifest, fh, indent=1)
    os.replace(manifest_path + ".tmp", manifest_path)
    for name, info in manifest["files"].items():
        same = ""
        if old is not None:
            same = (
                " (matches previous)" if old["files"][name]["sha256"] == info["sha256"] else " (DIFFERS from previous)"
            )
        print(
            f"{name}: {info['documents']} docs, {info['words']} words, {info['bytes']} bytes, sha256 "
            f"{info['sha256']}{same}"
        )


if __name__ == "__main__":
    main()
