#!/usr/bin/env python3
"""Print the imports between the crate's modules and any cycles among them.

Usage: bench/module_graph.py [--depth N] [SRC]   (default depth 1: top-level modules; SRC=src)

Every `crate::a::b` path in a file under src/a/ (or src/a.rs) counts as an edge a -> b at depth 1,
a/x -> b/y at depth 2. `super::` paths are resolved against the file's own module path. Exit status
1 when a cycle exists, so the script can guard the layering in a pre-commit hook.
"""
import os
import re
import sys


def module_path(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return rel


def edges(src, depth):
    found = {}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            me = module_path(src, path)
            if not me:
                continue
            text = open(path, encoding="utf-8").read()
            # Strip line comments so paths named in prose do not count.
            text = re.sub(r"//[^\n]*", "", text)
            targets = [m.split("::") for m in re.findall(r"\bcrate((?:::\w+)+)", text)]
            targets = [t[1:] for t in targets]
            for m in re.findall(r"\b((?:super::)+)(\w+(?:::\w+)*)", text):
                ups = m[0].count("super::")
                # A mod.rs file is its directory's module; `super` climbs from there.
                base = me[: len(me) - ups]
                targets.append(base + m[1].split("::"))
            # `use crate::{a, b::c}` groups
            for group in re.findall(r"\bcrate::\{([^}]*)\}", text):
                for item in group.split(","):
                    item = item.strip()
                    if item:
                        targets.append(item.split("::"))
            a = "/".join(me[:depth])
            for t in targets:
                t = [x for x in t if x]
                if not t:
                    continue
                b = "/".join(t[:depth])
                if b != a and t[0] == t[0].lower() and not a.startswith(b + "/") and not b.startswith(a + "/"):
                    found.setdefault((a, b), set()).add("/".join(me))
    return found


def cycles(pairs):
    graph = {}
    for a, b in pairs:
        graph.setdefault(a, set()).add(b)
    out, index, low, stack, on, counter = [], {}, {}, [], set(), [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main():
    args = sys.argv[1:]
    depth = 1
    if args[:1] == ["--depth"]:
        depth = int(args[1])
        args = args[2:]
    src = args[0] if args else "src"
    found = edges(src, depth)
    # Only edges between real modules (the first segment names a file or folder under src/).
    known = {module_path(src, os.path.join(r, f))[0]
             for r, _, fs in os.walk(src) for f in fs if f.endswith(".rs")
             if module_path(src, os.path.join(r, f))}
    pairs = sorted(p for p in found if p[1].split("/")[0] in known)
    for a, b in pairs:
        print(f"{a} -> {b}    ({len(found[(a, b)])} files)")
    cyc = cycles(pairs)
    for c in cyc:
        print("cycle: " + " <-> ".join(c))
    if not cyc:
        print("no cycles")
    return 1 if cyc else 0


if __name__ == "__main__":
    sys.exit(main())
