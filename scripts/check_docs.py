#!/usr/bin/env python3
"""Check the documentation: links, anchors, routes and flags.

  python3 scripts/check_docs.py --bin target/debug/layertap   # the repository's docs
  python3 scripts/check_docs.py --self-test                   # the check fails on broken docs

What it checks, in README.md, docs/*.md and clients/python/README.md:
- every relative link points at a file or folder that exists, and every `#anchor` (in the same
  file or in another Markdown file) names a heading there, by GitHub's rules: the heading's text
  lowercased, punctuation other than `-` and `_` dropped, spaces turned into `-`, and a repeated
  heading suffixed -1, -2, ...; `<a name=...>` / `id=...` anchors count too;
- every route of openapi/openapi.json (its `paths`, with their methods) is written as
  `METHOD /path` in docs/api.md;
- every long flag of every subcommand `layertap --help` lists (serve, bulk, extract, bench, ...)
  appears in docs/*.md.

The binary comes from --bin or $LAYERTAP_BIN. Python 3 standard library only. Exit status 1 and
one line per problem when anything is wrong.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unicodedata

DOC_FILES = ["README.md", "clients/python/README.md"]
DOC_DIR = "docs"
API_PAGE = "docs/api.md"
OPENAPI = "openapi/openapi.json"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# Flags every subcommand has, which need no page of their own.
GENERIC_FLAGS = {"--help", "--version"}

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
HTML_ID = re.compile(r"<[a-z][^>]*\bid\s*=\s*[\"']([^\"']+)[\"']", re.I)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_HREF = re.compile(r"<a\s[^>]*\bhref\s*=\s*[\"']([^\"']+)[\"']", re.I)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose_lines(text):
    """The lines outside fenced code blocks, with their line numbers."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                continue
            yield number, line
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                and not line.strip().lstrip(fence[0]).strip():
            fence = None  # a closing fence: the fence's character, no fewer, nothing after


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    kept = []
    for c in text:
        if c in "-_ ":
            kept.append(c)
        elif c.isalnum() or unicodedata.category(c).startswith("M"):
            kept.append(c)
    return "".join(kept).replace(" ", "-")


def anchors_of(path, cache={}):
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        seen = {}
        found = set()
        for _, line in prose_lines(text):
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
            for rx in (HTML_ANCHOR, HTML_ID):
                found.update(a for a in rx.findall(line))
        cache[path] = found
    return cache[path]


def links_of(text):
    for number, line in prose_lines(text):
        bare = CODE_SPAN.sub("", line)
        for rx in (INLINE_LINK, REF_DEF, HTML_HREF):
            for target in rx.findall(bare):
                yield number, target


def check_links(root, files):
    problems = []
    for rel in files:
        path = os.path.join(root, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for number, target in links_of(text):
            where = f"{rel}:{number}"
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
                continue  # http:, https:, mailto: ...: not checked here
            file_part, _, anchor = target.partition("#")
            if file_part:
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                if os.path.relpath(dest, root).split(os.sep)[0] == "..":
                    problems.append(f"{where}: link {target!r} leaves the repository")
                    continue
                if not os.path.exists(dest):
                    problems.append(f"{where}: link {target!r}: no such file or folder")
                    continue
            else:
                dest = path
            if anchor:
                if dest.endswith(".md") and os.path.isfile(dest):
                    if anchor not in anchors_of(dest):
                        shown = os.path.relpath(dest, root)
                        problems.append(f"{where}: link {target!r}: no heading with anchor #{anchor} in {shown}")
                elif not re.fullmatch(r"L\d+(-L\d+)?", anchor):
                    problems.append(f"{where}: link {target!r}: an anchor into a file that is not Markdown")
    return problems


def doc_files(root):
    files = [f for f in DOC_FILES if os.path.isfile(os.path.join(root, f))]
    docs = os.path.join(root, DOC_DIR)
    if os.path.isdir(docs):
        files += sorted(f"{DOC_DIR}/{n}" for n in os.listdir(docs) if n.endswith(".md"))
    return files


def check_routes(root):
    with open(os.path.join(root, OPENAPI), encoding="utf-8") as f:
        paths = json.load(f)["paths"]
    api = os.path.join(root, API_PAGE)
    if not os.path.isfile(api):
        return [f"{API_PAGE}: missing (it documents the routes)"]
    with open(api, encoding="utf-8") as f:
        text = f.read()
    problems = []
    for route, item in paths.items():
        for method in item:
            if method.lower() not in HTTP_METHODS:
                continue
            written = f"{method.upper()} {route}"
            if not re.search(re.escape(written) + r"(?![\w/-])", text):
                problems.append(f"{API_PAGE}: route `{written}` of {OPENAPI} is not documented")
    return problems


def help_text(binary, *args):
    out = subprocess.run([binary, *args, "--help"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"{binary} {' '.join(args)} --help failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def subcommands(binary):
    text = help_text(binary)
    m = re.search(r"^Commands:\n((?:[ \t]+\S.*\n?)+)", text, re.M)
    if not m:
        return []
    names = [line.split()[0] for line in m.group(1).splitlines() if line.strip()]
    return [n for n in names if n != "help"]


def long_flags(text):
    flags = []
    for line in text.splitlines():
        m = re.match(r"^\s+(?:-\w,\s+)?(--[a-z0-9][a-z0-9-]*)", line)
        if m and m.group(1) not in GENERIC_FLAGS:
            flags.append(m.group(1))
    return flags


def check_flags(root, binary):
    docs = os.path.join(root, DOC_DIR)
    text = ""
    for name in sorted(os.listdir(docs)) if os.path.isdir(docs) else []:
        if name.endswith(".md"):
            with open(os.path.join(docs, name), encoding="utf-8") as f:
                text += f.read() + "\n"
    problems = []
    commands = subcommands(binary)
    if not commands:
        problems.append(f"{binary} --help lists no subcommands")
    for command in commands:
        for flag in long_flags(help_text(binary, command)):
            if not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text):
                problems.append(f"{DOC_DIR}/: flag {flag} of `layertap {command}` is not documented")
    return problems


def check(root, binary):
    problems = check_links(root, doc_files(root))
    problems += check_routes(root)
    problems += check_flags(root, binary)
    return problems


# ---- self-test: a small docs tree that passes, then the same tree broken in each way ----

FAKE_HELP = {
    "": "Usage: layertap <COMMAND>\n\nCommands:\n  serve  Serve\n  bulk   Bulk\n  help   Help\n\n"
        "Options:\n  -h, --help     Print help\n  -V, --version  Print version\n",
    "serve": "Usage: layertap serve [OPTIONS]\n\nOptions:\n      --model <MODEL>\n          Model\n\n"
             "      --max-inputs <N>\n          Most inputs\n\n  -h, --help\n          Print help\n",
    "bulk": "Usage: layertap bulk [OPTIONS]\n\nOptions:\n      --out <OUT>\n          Folder\n\n"
            "  -h, --help\n          Print help\n",
}

GOOD_TREE = {
    "README.md": "# Sample\n\nSee [the API](docs/api.md#routes) and [below](#two-words-here).\n\n"
                 "## Two `words` here!\n\nAnd [twice](docs/api.md#routes-1), [the guide](docs/).\n\n"
                 "```\n[not a link](nowhere.md)\n```\n",
    "docs/api.md": "# API\n\n## Routes\n\n`GET /health`, `POST /v1/hidden-states`.\n\n## Routes\n\n"
                   "Flags: `--model`, `--max-inputs`, `--out`.\n",
    "clients/python/README.md": "# Client\n\n[Home](../../README.md#sample)\n",
    "openapi/openapi.json": json.dumps({"paths": {"/health": {"get": {}},
                                                  "/v1/hidden-states": {"post": {}, "parameters": []}}}),
}

# Each break: (file, old text, new text, what the check must report).
BREAKS = [
    ("README.md", "docs/api.md#routes)", "docs/apii.md#routes)", "no such file"),
    ("README.md", "(#two-words-here)", "(#two-words-there)", "no heading with anchor #two-words-there"),
    ("README.md", "#routes-1)", "#routes-2)", "no heading with anchor #routes-2"),
    ("clients/python/README.md", "#sample)", "#sampel)", "no heading with anchor #sampel"),
    ("docs/api.md", "`POST /v1/hidden-states`", "`POST /v1/hidden-state`", "route `POST /v1/hidden-states`"),
    ("docs/api.md", "`--max-inputs`", "`--max-input`", "flag --max-inputs of `layertap serve`"),
    ("docs/api.md", "`--out`", "`--output`", "flag --out of `layertap bulk`"),
]


def write_tree(root, tree):
    for rel, text in tree.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def fake_binary(folder):
    path = os.path.join(folder, "layertap")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"#!{sys.executable}\nimport sys\nHELP = {FAKE_HELP!r}\n"
                "args = [a for a in sys.argv[1:] if a != '--help']\n"
                "sys.stdout.write(HELP[args[0] if args else ''])\n")
    os.chmod(path, 0o755)
    return path


def run_on(root, binary):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--root", root, "--bin", binary],
                         capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def self_test():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = fake_binary(tmp)
        good = os.path.join(tmp, "good")
        write_tree(good, GOOD_TREE)
        rc, out = run_on(good, binary)
        if rc != 0:
            failures.append(f"the intact sample failed (exit {rc}):\n{out}")
        for i, (rel, old, new, expected) in enumerate(BREAKS):
            tree = dict(GOOD_TREE)
            assert old in tree[rel], (rel, old)
            tree[rel] = tree[rel].replace(old, new, 1)
            broken = os.path.join(tmp, f"broken-{i}")
            write_tree(broken, tree)
            rc, out = run_on(broken, binary)
            if rc == 0 or expected not in out:
                failures.append(f"sample broken in {rel} ({old!r} -> {new!r}): exit {rc}, "
                                f"expected a report of {expected!r}; got:\n{out}")
            else:
                print(f"self-test: broken {rel} ({old!r} -> {new!r}) fails as it should: "
                      f"{out.strip().splitlines()[0]}")
        shutil.rmtree(good)
    if failures:
        print("check_docs self-test FAILED:", *failures, sep="\n", file=sys.stderr)
        return 1
    print(f"check_docs self-test: the intact sample passes, all {len(BREAKS)} broken samples fail")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default=os.environ.get("LAYERTAP_BIN"),
                        help="the layertap binary whose --help lists the flags (default: $LAYERTAP_BIN)")
    parser.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                        help="the repository's root (default: this script's parent folder)")
    parser.add_argument("--self-test", action="store_true",
                        help="check that the check fails on deliberately broken samples")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    if not args.bin:
        parser.error("give the layertap binary with --bin or LAYERTAP_BIN")
    root = os.path.abspath(args.root)
    problems = check(root, os.path.abspath(args.bin))
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    files = doc_files(root)
    print(f"check_docs: {len(files)} files, their links and anchors, every route and flag documented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
