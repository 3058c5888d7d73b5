"""Fails when the crate's modules reach each other in a way the layout forbids.

Every path a module uses is read and resolved to the module it names:
`crate::a::b`, `super::x` (at any depth, counted from an inline `mod x { }`
where the path stands in one), `self::x`, and a child's name (`use child::x`),
in `use` lines and in code (comments and test code left out; `mod` lines are
not uses, nor, for rules 1 and 2, `pub use` re-exports). Three rules:

1. No cycle among siblings, at every level: the children of each module (the
   crate's top-level modules, `store`'s `local`, `mpi` and `param_server`, ...)
   each stand for everything below them, and their uses must form no cycle.
   A parent's own file may use its children and they it; that is not a cycle.
2. No private reach: a module never names an item that another module
   declares without `pub`, nor a private field of a struct its ancestor
   declares (Rust lets a child read its parent's private items and fields;
   here a child uses only what its parent offers as an API, with a `pub`).
3. No upward use: every module belongs to a layer of the table under "## The
   layers" in docs/architecture.md (top layer first), and uses (re-exports
   included) only modules of its own layer or of layers below it. A row's
   `files` column names `src/` folders (`src/x/`: everything under it) and
   files (`src/x.rs`: that module); a bare name after one (`key.rs`) lies in
   the same folder. The most specific path that covers a module gives its
   layer, so `src/store/mpi/world.rs` may be a layer below `src/store/`. A
   module no row covers fails, and so does a path that names no module.
   `--allow MODULE` (repeatable, `a::b`) leaves a module out of this rule.

`python3 scripts/module_cycles.py --self-test` checks the rules on small
trees made for it. Run by scripts/test.sh."""
import argparse
import bisect
import os
import re
import sys
import tempfile

LAYERS_DOC = "docs/architecture.md"


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


def inline_scopes(lines):
    """For each line, the names of the inline `mod name { }` blocks it stands in, outermost first."""
    scopes, stack, depth = [], [], 0
    for line in lines:
        scopes.append(tuple(name for name, _ in stack))
        bare = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'', '""', line)
        m = re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*\{", bare)
        if m:
            stack.append((m.group(1), depth))
        depth += bare.count("{") - bare.count("}")
        while stack and depth <= stack[-1][1]:
            stack.pop()
    return scopes


def uses(mod, code, mods, reexports=False):
    """(target module, item name or None) for every path the module names; `pub use` lines count with reexports."""
    found = []
    lines = code.splitlines()
    scopes = inline_scopes(lines)
    # Dropped lines stay as empty ones, so an offset still finds its line.
    text = "\n".join("" if re.match(r"\s*(pub(\([^)]*\))?\s+)?mod\s", l) or (not reexports and re.match(r"\s*pub(\([^)]*\))?\s+use\s", l)) else l
                     for l in lines)
    starts = [m.end() for m in re.finditer("\n", text)]
    paths = [(m.group(1), bisect.bisect(starts, m.start())) for m in re.finditer(r"(?<![\w:])((?:crate|super|self|\w+)(?:::\w+)+)", text)]
    # Expand `use a::{b, c::d}` one level, so each name is resolved.
    for m in re.finditer(r"\buse\s+([\w:]+)::\{([^}]*)\}", text):
        for item in m.group(2).split(","):
            item = item.strip().split(" as ")[0]
            if item:
                paths.append((m.group(1) if item == "self" else "%s::%s" % (m.group(1), item), bisect.bisect(starts, m.start())))
    children = {m[len(mod)] for m in mods if len(m) == len(mod) + 1 and m[: len(mod)] == mod}
    for path, line in paths:
        parts = path.split("::")
        if parts[0] == "crate":
            base, rest = (), parts[1:]
        elif parts[0] in ("super", "self"):
            base = mod + scopes[line]
            while parts and parts[0] in ("super", "self"):
                if parts[0] == "super":
                    base = base[:-1]
                parts = parts[1:]
            rest = parts
            if len(base) > len(mod):
                continue  # an item of the module's own inline modules
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


def read_layers(text):
    """[(layer, [(path as written, module path, is a folder)])] from the table under "## The layers", top first."""
    section = re.search(r"^## The layers\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    rows = [l.strip().strip("|").split("|") for l in (section.group(1) if section else "").splitlines() if l.startswith("|")]
    if not rows or "layer" not in [c.strip() for c in rows[0]] or "files" not in [c.strip() for c in rows[0]]:
        return None
    head = [c.strip() for c in rows[0]]
    layers = []
    for row in rows[1:]:
        if re.fullmatch(r"[-: ]*", row[0]):
            continue
        paths, folder = [], None
        for name in re.findall(r"`([^`]+)`", row[head.index("files")]):
            if name.startswith("src/"):
                path = name
            elif folder is not None and re.fullmatch(r"\w+(\.rs|/)", name):
                path = folder + name  # `key.rs` after `src/error.rs`
            else:
                continue
            folder = path if path.endswith("/") else path.rsplit("/", 1)[0] + "/"
            parts = tuple(path[len("src/"):].rstrip("/").removesuffix(".rs").split("/"))
            if parts[-1] == "mod" and not path.endswith("/"):
                parts = parts[:-1]
            paths.append((path, parts, path.endswith("/")))
        layers.append((row[head.index("layer")].strip(), paths))
    return layers


def layer_problems(files, edges, layers, allow):
    """Rule 3 over {module: its file as `src/...`}: (problems, the upward uses of allowed modules)."""
    problems, allowed = [], []
    order = {name: i for i, (name, _) in enumerate(layers)}
    entries = {}
    for name, paths in layers:
        for path, parts, folder in paths:
            if (parts, folder) in entries:
                problems.append("layer table: %s is in both %r and %r" % (path, entries[parts, folder][0], name))
            entries[parts, folder] = (name, path)
            if not any(m == parts or (folder and m[: len(parts)] == parts) for m in files):
                problems.append("layer table: %r lists %s, which is no module under src/" % (name, path))

    def layer_of(mod):
        covering = [(len(parts), not folder, name) for (parts, folder), (name, _) in entries.items()
                    if mod == parts or (folder and mod[: len(parts)] == parts)]
        return max(covering)[2] if covering else None

    layer = {m: layer_of(m) for m in files}
    for mod in sorted(files):
        if layer[mod] is None and mod not in allow:
            problems.append("layer: %s (%s) is not in any layer of %s" % ("::".join(mod), files[mod], LAYERS_DOC))
    for a, b in sorted(edges):
        if layer[a] is None or layer[b] is None or order[layer[b]] >= order[layer[a]]:
            continue
        line = "layer: %s (%s) uses %s (%s), a layer above its own" % ("::".join(a), layer[a], "::".join(b), layer[b])
        (allowed if a in allow or b in allow else problems).append(line)
    return problems, allowed


def check(src, layers=None, allow=()):
    """(problems, modules, sibling uses, allowed upward uses); rule 3 only with the layer table."""
    mods = modules(src)
    codes = {m: code_of(p) for m, p in mods.items()}
    private = {m: private_items(c) for m, c in codes.items()}
    fields = {m: private_fields(c) for m, c in codes.items()}
    problems = []
    edges, layer_edges = set(), set()
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
        layer_edges |= {(mod, target) for target, _ in uses(mod, code, mods, reexports=True)}
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
    allowed = []
    if layers is not None:
        files = {m: "src/" + os.path.relpath(p, src).replace(os.sep, "/") for m, p in mods.items()}
        more, allowed = layer_problems(files, layer_edges, layers, allow)
        problems += more
    return sorted(set(problems)), len(mods), len(sibling_edges), allowed


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

    # Rule 3. `link` lies in src/mid/ (stores) but its own row (transports) is more specific; the
    # `super` in an inline module counts from it (wire's `super::Frame` is its own item, not `mid`'s).
    doc = """## The layers

| layer | files | what it owns |
|---|---|---|
| fronts | `python/pkg/`, `cpp/` | no Rust |
| top | `src/top.rs` | |
| stores | `src/mid/` | |
| transports | `src/mid/wire.rs` + `link.rs` | |
| ground | `src/base.rs`, `util.rs`, `gone.rs` | |

## Next

| layer | files |
|---|---|
| other | `src/stray.rs` |
"""
    files = {"lib.rs": "", "top.rs": "use crate::mid::Store;\npub struct T;\n",
             "mid/mod.rs": "pub mod link;\npub mod wire;\npub struct Store;\nfn f() { wire::send() }\n",
             "mid/wire.rs": "use crate::base::B;\npub struct Frame;\npub fn send() {}\nmod imp {\n    use super::Frame;\n    use super::super::link::Link;\n}\n",
             "mid/link.rs": "pub struct Link;\nmod imp {\n    use super::super::Store;\n}\n",
             "base.rs": "pub use crate::top::T;\npub struct B;\n", "util.rs": "fn f() { crate::top::T; }\n", "stray.rs": ""}
    layered = tree(files)
    upward = ["layer: base (ground) uses top (top), a layer above its own",
              "layer: mid::link (transports) uses mid (stores), a layer above its own",
              "layer: util (ground) uses top (top), a layer above its own"]
    assert check(layered, read_layers(doc)) == (sorted(["layer table: 'ground' lists src/gone.rs, which is no module under src/",
                                                        "layer: stray (src/stray.rs) is not in any layer of docs/architecture.md"] + upward),
                                                7, 4, []), check(layered, read_layers(doc))
    problems, _, _, allowed = check(layered, read_layers(doc), allow={("util",)})
    assert upward[2] not in problems and upward[1] in problems and allowed == [upward[2]], (problems, allowed)
    clean = dict(files, **{"mid/link.rs": "pub struct Link;\n", "base.rs": "pub struct B;\n", "util.rs": "fn f() { crate::base::B; }\n"})
    del clean["stray.rs"]
    assert check(tree(clean), read_layers(doc.replace(", `gone.rs`", ""))) == ([], 6, 4, []), check(tree(clean), read_layers(doc.replace(", `gone.rs`", "")))
    twice = read_layers("## The layers\n\n| layer | files |\n|---|---|\n| a | `src/x.rs` |\n| b | `src/x.rs` |\n")
    assert layer_problems({("x",): "src/x.rs"}, set(), twice, ()) == (["layer table: src/x.rs is in both 'a' and 'b'"], []), twice
    assert read_layers("## The layers\n\nno table\n") is None
    print("module check self-test: a private reach, cycles (siblings, nested, top level), upward uses (from an inline module and"
          " a re-export too), a module in no layer and a stale layer row are caught; downward uses and a clean tree pass")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", nargs="?", default=os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")))
    parser.add_argument("--self-test", action="store_true", help="check the rules on trees made for it")
    parser.add_argument("--allow", action="append", default=[], metavar="MODULE",
                        help="leave a module (a::b) out of rule 3, the layers; repeatable")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return
    doc = os.path.join(args.src, os.pardir, LAYERS_DOC)
    layers = read_layers(open(doc).read()) if os.path.exists(doc) else None
    if not layers:
        sys.exit("module layout: no layer table (| layer | files | ...) under \"## The layers\" in %s" % doc)
    allow = {tuple(a.split("::")) for a in args.allow}
    mods = modules(args.src)
    unknown = sorted("::".join(a) for a in allow if a not in mods)
    if unknown:
        sys.exit("module layout: --allow names no module under %s: %s" % (args.src, ", ".join(unknown)))
    problems, n, e, allowed = check(args.src, layers, allow)
    if problems:
        sys.exit("module layout:\n  " + "\n  ".join(problems))
    for line in allowed:
        print("allowed (--allow): " + line[len("layer: "):])
    print("no module cycles, no private reaches and no upward uses among %d modules (%d sibling uses, %d layers)" % (n, e, len(layers)))


if __name__ == "__main__":
    main()
