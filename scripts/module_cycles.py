"""Fails when the crate's top-level modules import each other in a cycle.

Reads every `crate::<module>` path in src/ (comments and test code left out;
lib.rs's re-export `compression` -> `quant` added) and looks for a path back.
Run by scripts/test.sh."""
import os
import re
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
edges = {("compression", "quant")}
for root, _, files in os.walk(SRC):
    for name in files:
        if not name.endswith(".rs"):
            continue
        path = os.path.join(root, name)
        parts = os.path.relpath(path, SRC)[:-3].split(os.sep)
        if parts[-1] == "mod":
            parts = parts[:-1]
        if parts == ["lib"] or parts[-1] in ("tests", "test"):
            continue
        text = re.split(r"#\[cfg\(test\)\]", open(path).read())[0]
        text = "\n".join(line.split("//")[0] for line in text.splitlines())
        edges |= {(parts[0], m) for m in re.findall(r"crate::(\w+)", text) if m != parts[0]}
graph = {}
for a, b in edges:
    graph.setdefault(a, set()).add(b)
cycles = []
for a, b in sorted(edges):
    seen, stack = {b}, [b]
    while stack:
        x = stack.pop()
        if x == a:
            cycles.append("%s -> %s -> ... -> %s" % (a, b, a))
            break
        for y in graph.get(x, ()):
            if y not in seen:
                seen.add(y)
                stack.append(y)
if cycles:
    sys.exit("module cycles:\n  " + "\n  ".join(cycles))
print("no module cycles among %d modules" % len(graph))
