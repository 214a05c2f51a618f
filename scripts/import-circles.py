#!/usr/bin/env python3
"""Import circles between the files of each crate: file A names an item of file B
(`use crate::b::X`, `super::b::f()`, `b::f()` for a module `b` that A declares, a path
anywhere in the code, re-exports included) and B, through any chain, names one of A's. A circle means neither file can be read, changed or moved
without the other (docs/ARCHITECTURE.md, end of "Crates").

Usage: scripts/import-circles.py [--known FILE]
Prints each circle as `crate: file, file, ...`. Exits 1 if there is a circle that FILE
(one circle per line, as printed) does not list, or FILE lists one that is gone, so
the list only shrinks. scripts/test.sh runs it with scripts/import-circles.known.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# A path that starts at the crate's root or at a parent module: crate::a::b, super::super::a.
PATH = re.compile(rf"\b((?:crate|super|self)(?:::(?:{IDENT}|\{{[^;]*?\}}))+)")


def module_of(src: Path, file: Path) -> tuple:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("lib", "main", "mod"):
        parts = parts[:-1]
    return tuple(parts)


def strip(text: str) -> str:
    """`text` with comments, strings and char literals blanked (a small Rust lexer)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                depth += text.startswith("/*", i) - text.startswith("*/", i)
                i += 2 if text.startswith(("/*", "*/"), i) else 1
        elif raw := re.match(r'b?r(#*)"', text[i : i + 300]):
            close = '"' + raw.group(1)
            end = text.find(close, i + raw.end())
            i = n if end < 0 else end + len(close)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(?:\\.[^']*|[^'\\])'", text[i : i + 12]):
            i = text.index("'", i + 2) + 1  # a char literal (a lifetime has no closing quote)
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def code_of(text: str) -> str:
    """The file's code: no comments, string literals or unit-test modules."""
    text = strip(text)
    while cut := re.search(r"#\[cfg\(test\)\]\s*mod \w+\s*\{", text):
        depth, end = 0, len(text)
        for i in range(cut.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                end = i + 1
                break
        text = text[: cut.start()] + text[end:]
    return text


def expand(path: str) -> list:
    """`a::{b, c::d}` as ["a::b", "a::c::d"] (one level of braces is enough here)."""
    m = re.match(r"(.*?)::\{(.*)\}$", path, flags=re.S)
    if not m:
        return [path]
    out = []
    depth, item = 0, ""
    for ch in m.group(2) + ",":
        if ch == "," and depth == 0:
            if item.strip():
                out.extend(expand(m.group(1) + "::" + item.strip()))
            item = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        item += ch
    return out


def edges_of(src: Path) -> dict:
    files = {module_of(src, f): f for f in src.rglob("*.rs")}
    edges = {m: set() for m in files}
    for here, file in files.items():
        code = code_of(file.read_text())
        children = set(re.findall(rf"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+({IDENT})\s*;", code, flags=re.M))
        bare = re.compile(rf"(?<![A-Za-z0-9_:])((?:{'|'.join(map(re.escape, children)) or '(?!)'})(?:::(?:{IDENT}|\{{[^;]*?\}}))+)")
        found = PATH.findall(code) + ["self::" + b for b in bare.findall(code)]
        for raw in found:
            for path in expand(re.sub(r"\s+", "", raw)):
                parts = path.split("::")
                if parts[0] == "crate":
                    base, rest = (), parts[1:]
                else:
                    # `self` is this file's module, each `super` one level up.
                    base, rest = here, parts
                    while rest and rest[0] in ("super", "self"):
                        if rest[0] == "super":
                            base = base[:-1]
                        rest = rest[1:]
                # The longest prefix that is a file of the crate.
                target = base
                for part in rest:
                    if base + (part,) in files:
                        base = base + (part,)
                        target = base
                    else:
                        break
                if target != here and target in files:
                    edges[here].add(target)
    return {files[m]: {files[t] for t in ts} for m, ts in edges.items()}


def circles(edges: dict) -> list:
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(group)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    known = set()
    if len(sys.argv) == 3 and sys.argv[1] == "--known":
        known = {l.strip() for l in Path(sys.argv[2]).read_text().splitlines() if l.strip() and not l.startswith("#")}
    found = []
    for src in sorted(ROOT.glob("crates/*/src")):
        for group in circles(edges_of(src)):
            names = ", ".join(sorted(str(f.relative_to(src)) for f in group))
            found.append(f"{src.parent.name}: {names}")
    for line in sorted(found):
        print(line + ("" if line in known else "   <- new"))
    new = [l for l in found if l not in known]
    gone = sorted(known - set(found))
    for line in gone:
        print(f"{line}   <- gone: remove it from the known list")
    if new:
        print(f"{len(new)} import circle(s) not in the known list: break them (a third file both can use) rather than add them", file=sys.stderr)
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
