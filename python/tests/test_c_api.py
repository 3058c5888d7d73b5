"""Every ctypes declaration of the Python package against include/gradpack/c_api.h:
each function it declares exists there with the same argument and result
types (by ABI: ints of each width, floats, doubles, pointers, and structs
field by field), and base.DTYPES is gp_dtype_t. A declaration that drifts
from the header would otherwise pass wrong values silently."""
import ctypes
import os
import re

import pytest

HEADER = os.path.join(os.path.dirname(__file__), "..", "..", "include", "gradpack", "c_api.h")

C_SCALARS = {"int": "i32", "int64_t": "i64", "uint64_t": "u64", "uint32_t": "u32", "float": "f32", "double": "f64",
             "void": "void", "gp_dtype_t": "i32"}
CTYPES_SCALARS = {ctypes.c_int: "i32", ctypes.c_int64: "i64", ctypes.c_uint64: "u64", ctypes.c_uint32: "u32",
                  ctypes.c_float: "f32", ctypes.c_double: "f64", ctypes.c_uint8: "u8"}


def parse_header():
    text = open(HEADER).read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*|#[^\n]*", " ", text)
    text = re.sub(r"\s+", " ", text)
    fnptrs = set(re.findall(r"typedef \w+ \(\*(\w+)\)\([^)]*\);", text))

    def kind(decl, structs):
        """The ABI kind of a declaration such as 'const uint64_t* shape'."""
        if "*" in decl or any(re.search(r"\b%s\b" % f, decl) for f in fnptrs):
            return "ptr"
        words = [w for w in re.findall(r"\w+", decl) if w != "const"]
        base = words[0]
        if base in structs:
            return ("struct", structs[base])
        assert base in C_SCALARS, "c_api.h: a type this test does not know: %r" % decl
        return C_SCALARS[base]

    structs = {}
    for body, name in re.findall(r"typedef struct \{([^}]*)\} (\w+);", text):
        structs[name] = tuple(kind(f, structs) for f in body.split(";") if f.strip())
    functions = {}
    for ret, name, params in re.findall(r"([\w\s\*]+?)\b(gp_\w+)\(([^()]*)\);", text):
        params = params.strip()
        args = [] if params in ("", "void") else [kind(p, structs) for p in params.split(",")]
        functions[name] = (kind(ret, structs), args)
    return structs, functions


def ctypes_kind(t):
    if t is None:
        return "void"
    if t in CTYPES_SCALARS:
        return CTYPES_SCALARS[t]
    if t in (ctypes.c_char_p, ctypes.c_void_p) or issubclass(t, (ctypes._Pointer, ctypes._CFuncPtr)):
        return "ptr"
    if issubclass(t, ctypes.Structure):
        return ("struct", tuple(ctypes_kind(f[1]) for f in t._fields_))
    raise AssertionError("a ctypes type this test does not know: %r" % (t,))


def declared_functions():
    import gradpack.base
    import gradpack.cuda  # noqa: F401 (each module declares what it calls)
    import gradpack.kv  # noqa: F401
    import gradpack.nd.contrib  # noqa: F401
    import gradpack.torch  # noqa: F401
    return {name: fn for name, fn in vars(gradpack.base.LIB).items() if name.startswith("gp_")}


def test_every_ctypes_declaration_matches_the_header():
    _, header = parse_header()
    declared = declared_functions()
    assert len(declared) > 50 and len(header) > 50, (len(declared), len(header))
    wrong = []
    for name, fn in sorted(declared.items()):
        if name not in header:
            wrong.append("%s: not in c_api.h" % name)
            continue
        ret, args = header[name]
        if fn.argtypes is None and args:
            wrong.append("%s: called without argtypes; c_api.h takes %s" % (name, args))
        elif fn.argtypes is not None and [ctypes_kind(a) for a in fn.argtypes] != args:
            wrong.append("%s: argtypes %s, c_api.h %s" % (name, [ctypes_kind(a) for a in fn.argtypes], args))
        if ctypes_kind(fn.restype) != ret:
            wrong.append("%s: restype %s, c_api.h %s" % (name, ctypes_kind(fn.restype), ret))
    assert wrong == [], "\n".join(wrong)


def test_the_parser_reads_the_header_as_c_does():
    """Known declarations, parsed (the check above would pass vacuously if
    the parser read every type as a pointer, or found no functions)."""
    structs, functions = parse_header()
    key = ("struct", ("i64", "ptr"))
    assert structs["gp_key_t"] == key[1]
    assert structs["gp_array_t"] == ("ptr", "i32", "i32", "ptr")
    assert functions["gp_2bit_quantize"] == ("i32", ["ptr", "i32", "u64", "ptr", "u64", "ptr", "u64", "f32", "f32"])
    assert functions["gp_kvstore_set_rates"] == ("i32", ["ptr", key, "f64", "f64"])
    assert functions["gp_kvstore_set_updater"] == ("i32", ["ptr", "ptr", "ptr"])
    assert functions["gp_2bit_compressed_len"] == ("u64", ["u64"])
    assert functions["gp_error_last"] == ("ptr", [])
    assert functions["gp_kvstore_free"] == ("void", ["ptr"])


def test_the_dtype_table_is_the_headers():
    from gradpack.base import DTYPES
    text = open(HEADER).read()
    enum = {name.lower(): int(v) for name, v in re.findall(r"GP_DTYPE_(\w+) = (\d+)", text)}
    assert enum == {"float32": 0, "float16": 1, "bfloat16": 2}
    assert DTYPES == enum


def test_a_drifted_declaration_is_caught():
    """The check itself: one argument type changed is reported."""
    declared = declared_functions()
    fn = declared["gp_kvstore_set_rates"]
    saved = fn.argtypes
    try:
        fn.argtypes = saved[:-1] + [ctypes.c_float]
        with pytest.raises(AssertionError, match="gp_kvstore_set_rates: argtypes"):
            test_every_ctypes_declaration_matches_the_header()
    finally:
        fn.argtypes = saved
