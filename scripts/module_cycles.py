"""Fails when the crate's modules reach each other in a way the layout forbids.

Every path a module uses is read and resolved to the module it names:
`crate::a::b`, `super::x` (at any depth), `self::x`, and a child's name (`use
child::x`), in `use` lines and in code (comments and test code left out;
`pub use` re-exports and `mod` lines are not uses). Two rules:

1. No cycle among siblings, at every level: the children of each module (the
   crate's top-level modules, `store`'s `local`, `mpi` and `param_server`, ...)
   each stand for everything below them, and their uses must form no cycle.
   A parent's own file may use its children and they it; that is not a cycle.
2. No private reach: a module never names an item that another module
   declares without `pub`, nor a private field of a struct its ancestor
   declares (Rust lets a child read its parent's private items and fields;
   here a child uses only what its parent offers as an API, with a `pub`).

`python3 scripts/module_cycles.py --self-test` checks both rules on small
trees made for it. Run by scripts/test.sh."""
import os
import re
import sys
import tempfile

def modules(src):
    """{module path tuple: file}, from the file tree."""
    found = {}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            parts = tuple(os.path.relpath(path, src)[:-3].split(os.sep))
            if parts[-1] == "mod":
                parts = parts[:-1]
            if parts in (("lib",), ("main",)) or parts[0] == "bin" or parts[-1] in ("tests", "test"):
                continue
            found[parts] = path
    return found


def code_of(path):
    text = re.split(r"#\[cfg\(test\)\]", open(path).read())[0]
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def private_items(code):
    """Names the file declares at its top level without `pub`."""
    names = set()
    for m in re.finditer(r"^(pub(?:\([^)]*\))?\s+)?(?:unsafe\s+)?(?:const\s+)?(?:extern\s+\"C\"\s+)?(fn|struct|enum|trait|const|static|type)\s+(\w+)", code, re.M):
        if not m.group(1):
            names.add(m.group(3))
    return names


def private_fields(code):
    """Field names of the file's structs declared without `pub`."""
    names = set()
    for body in re.findall(r"^(?:pub(?:\([^)]*\))?\s+)?struct\s+\w+(?:<[^>]*>)?\s*\{(.*?)^\}", code, re.M | re.S):
        names |= set(re.findall(r"^\s+(\w+)\s*:", body, re.M))
        names -= set(re.findall(r"^\s+pub(?:\([^)]*\))?\s+(\w+)\s*:", body, re.M))
    return names


def uses(mod, code, mods):
    """(target module, item name or None) for every path the module names."""
    found = []
    lines = [l for l in code.splitlines() if not re.match(r"\s*(pub(\([^)]*\))?\s+)?mod\s", l) and not re.match(r"\s*pub(\([^)]*\))?\s+use\s", l)]
    text = "\n".join(lines)
    # Expand `use a::{b, c::d}` one level, so each name is resolved.
    for m in re.finditer(r"\buse\s+([\w:]+)::\{([^}]*)\}", text):
        for item in m.group(2).split(","):
            item = item.strip().split(" as ")[0]
            if item:
                text += "\n%s::%s" % (m.group(1), "" if item == "self" else item)
    children = {m[len(mod)] for m in mods if len(m) == len(mod) + 1 and m[: len(mod)] == mod}
    for m in re.finditer(r"(?<![\w:])((?:crate|super|self|\w+)(?:::\w+)+)", text):
        parts = m.group(1).split("::")
        if parts[0] == "crate":
            base, rest = (), parts[1:]
        elif parts[0] in ("super", "self"):
            base = mod
            while parts and parts[0] in ("super", "self"):
                if parts[0] == "super":
                    base = base[:-1]
                parts = parts[1:]
            rest = parts
        elif parts[0] in children:
            base, rest = mod, parts
        else:
            continue
        target = base
        for i, p in enumerate(rest):
            nxt = target + (p,)
            if nxt in mods or any(k[: len(nxt)] == nxt for k in mods):
                target = nxt
                continue
            found.append((target, p))
            break
        else:
            found.append((target, None))
    return [(t, item) for t, item in found if t != mod and t != ()]


def check(src):
    mods = modules(src)
    codes = {m: code_of(p) for m, p in mods.items()}
    private = {m: private_items(c) for m, c in codes.items()}
    fields = {m: private_fields(c) for m, c in codes.items()}
    problems = []
    edges = set()
    for mod, code in codes.items():
        # A descendant may read its ancestors' private fields; here it must not.
        own = set(re.findall(r"^\s+(?:pub(?:\([^)]*\))?\s+)?(\w+)\s*:", code, re.M))
        for n in range(1, len(mod)):
            for f in sorted(fields.get(mod[:n], set()) - own):
                if re.search(r"\.%s\b(?!\s*\()" % f, code):
                    problems.append("private reach: %s uses field %s, private to %s" % ("::".join(mod), f, "::".join(mod[:n])))
        for target, item in uses(mod, code, mods):
            if item and item in private.get(target, ()):
                problems.append("private reach: %s uses %s, private to %s" % ("::".join(mod), item, "::".join(target)))
            edges.add((mod, target))
    # Rule 1: project each edge onto the two siblings under the pair's deepest common ancestor.
    sibling_edges = set()
    for a, b in edges:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        if n == len(a) or n == len(b):
            continue  # a parent's own file and its descendants
        sibling_edges.add((a[: n + 1], b[: n + 1]))
    graph = {}
    for a, b in sibling_edges:
        graph.setdefault(a, set()).add(b)
    for a, b in sorted(sibling_edges):
        seen, stack, back = {b}, [b], {b: None}
        while stack:
            x = stack.pop()
            if x == a:
                path, y = [], a
                while y is not None:
                    path.append("::".join(y))
                    y = back[y]
                problems.append("cycle: %s -> %s" % ("::".join(a), " -> ".join(reversed(path))))
                break
            for y in graph.get(x, ()):
                if y not in seen:
                    seen.add(y)
                    back[y] = x
                    stack.append(y)
    return sorted(set(problems)), len(mods), len(sibling_edges)


def self_test():
    def tree(files):
        d = tempfile.mkdtemp()
        for name, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
            open(os.path.join(d, name), "w").write(text)
        return d

    ok = tree({"lib.rs": "", "a/mod.rs": "pub mod b;\npub mod c;\npub use b::B;\npub fn shared() {}\n",
               "a/b.rs": "use super::shared;\npub struct B;\n", "a/c.rs": "use super::b::B;\n"})
    assert check(ok)[0] == [], check(ok)[0]
    private = tree({"lib.rs": "", "a/mod.rs": "pub mod b;\nstruct Entry;\nfn helper() {}\npub struct Store {\n    pub name: u8,\n    updater: u8,\n}\n",
                    "a/b.rs": "use super::{helper, Entry};\nfn f(s: &super::Store) -> u8 { s.updater + s.name }\n"})
    assert check(private)[0] == ["private reach: a::b uses Entry, private to a", "private reach: a::b uses field updater, private to a",
                                 "private reach: a::b uses helper, private to a"], check(private)[0]
    cycle = tree({"lib.rs": "", "a/mod.rs": "pub mod b;\npub mod c;\n", "a/b.rs": "pub fn f() { super::c::g() }\n",
                  "a/c/mod.rs": "pub mod d;\npub fn g() {}\n", "a/c/d.rs": "use crate::a::b::f;\n"})
    assert any(p.startswith("cycle: a::b -> a::c -> a::b") for p in check(cycle)[0]), check(cycle)[0]
    top = tree({"lib.rs": "", "x.rs": "use crate::y::Y;\npub struct X;\n", "y.rs": "pub struct Y;\nfn f() { crate::x::X; }\n"})
    assert any(p.startswith("cycle: x -> y -> x") for p in check(top)[0]), check(top)[0]
    print("module check self-test: a private reach and cycles (siblings, nested, top level) are caught; a clean tree passes")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        sys.exit(0)
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    problems, n, e = check(src)
    if problems:
        sys.exit("module layout:\n  " + "\n  ".join(problems))
    print("no module cycles and no private reaches among %d modules (%d sibling uses)" % (n, e))
