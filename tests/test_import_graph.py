"""The import graph of ``ctuq/``: no cycle among module-level imports, and no import (module- or function-level) from
a lower layer to a higher one; and the one description of the layout (docs/DESIGN.md §2) against the tree: every path
it names exists, every package and module of ``ctuq/`` is named, the top level in layer order. The graph is read from
the source with ``ast`` (nothing is imported), so a failure lists the offending edges as ``module -> module (line)``."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ctuq"
ROOT = PACKAGE.parent
DESIGN = ROOT / "docs" / "DESIGN.md"

# Bottom → top (docs/DESIGN.md §2): a module may import from its own layer and the layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("ctuq", "errors", "options", "registry", "config", "memory", "utils", "geometry", "interrupt", "log"),
    ("data", "operators", "metrics", "outputs", "figures", "calibration"),
    ("scan",),
    ("models",),
    ("linearize",),
    ("inference",),
    ("reconstruct",),
    ("design", "classify"),
    ("pipeline",),
    ("run",),
    ("studies",),
    ("commands", "cli", "__main__", "testing", "viewer"),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """``(target module, line, at module level)`` for every import of a ctuq module in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def resolve(base: str, names: list[str]) -> list[str]:
        targets = []
        for n in names:
            full = f"{base}.{n}" if base else n
            targets.append(full if full in modules else base)
        return targets

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only: never executed
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append((alias.name, child.lineno, top))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1])
                    base = f"{base}.{child.module}" if child.module else base
                else:
                    base = child.module or ""
                for target in resolve(base, [a.name for a in child.names]):
                    found.append((target, child.lineno, top))
            elif (
                isinstance(child, ast.Call)
                and getattr(child.func, "id", getattr(child.func, "attr", None)) == "lazy_module"
                and child.args
                and isinstance(child.args[0], ast.Constant)
            ):
                # lazy_module("ctuq.x"): an import made when first used, so a layering edge but not a cycle edge
                found.append((child.args[0].value, child.lineno, False))
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return [(t, line, top) for t, line, top in found if t == "ctuq" or t.startswith("ctuq.")]


def _graph():
    modules = _modules()
    return modules, {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer_key(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_module_has_a_layer():
    modules, _ = _graph()
    missing = sorted({_layer_key(m) for m in modules} - set(LAYER))
    assert not missing, f"modules of ctuq without a layer in {__name__}.LAYERS: {missing}"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    _, graph = _graph()
    bad = []
    for src, edges in graph.items():
        for dst, line, top in edges:
            ls, ld = LAYER.get(_layer_key(src)), LAYER.get(_layer_key(dst))
            if ls is not None and ld is not None and ld > ls:
                where = "" if top else ", in a function"
                bad.append(
                    f"{src} ({_layer_key(src)}, layer {ls}) -> {dst} ({_layer_key(dst)}, layer {ld}) "
                    f"(line {line}{where})"
                )
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(set(bad)))


def test_module_level_imports_are_acyclic():
    _, graph = _graph()
    edges = {
        src: sorted({dst for dst, _, top in es if top and dst != src and dst in graph}) for src, es in graph.items()
    }
    # Tarjan's strongly connected components: every component with more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    lines = []
    for comp in cycles:
        members = set(comp)
        cyc_edges = [
            f"  {src} -> {dst} (line {line})"
            for src in comp
            for dst, line, top in graph[src]
            if top and dst in members and dst != src
        ]
        lines.append(f"cycle among {comp}:\n" + "\n".join(sorted(set(cyc_edges))))
    assert not cycles, "module-level import cycles:\n" + "\n".join(lines)


# The config package is a leaf: the schema and the override engine read registries (lazily), never the packages
# that fill them; mapping keys onto the core's arguments is the CT front end's (ctuq.pipeline.uq_settings).
CONFIG_MAY_IMPORT = ("ctuq.errors", "ctuq.options", "ctuq.registry", "ctuq.config")


def test_the_config_imports_only_leaves():
    _, graph = _graph()
    config = {name: edges for name, edges in graph.items() if name == "ctuq.config" or name.startswith("ctuq.config.")}
    assert {"ctuq.config", "ctuq.config.engine", "ctuq.config.schema"} <= set(config)
    bad = [
        f"{src} -> {dst} (line {line})"
        for src, edges in config.items()
        for dst, line, _ in edges
        if not any(dst == ok or dst.startswith(f"{ok}.") for ok in CONFIG_MAY_IMPORT)
    ]
    assert not bad, "the config imports beyond the leaves:\n" + "\n".join(bad)


def test_nothing_in_ctuq_imports_the_shipped_contracts():
    # ctuq.testing imports pytest: it is for test suites, never for the package itself
    _, graph = _graph()
    bad = [
        f"{src} -> {dst} (line {line})"
        for src, edges in graph.items()
        if src != "ctuq.testing" and not src.startswith("ctuq.testing.")
        for dst, line, _ in edges
        if dst == "ctuq.testing" or dst.startswith("ctuq.testing.")
    ]
    assert not bad, "ctuq modules that import ctuq.testing:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------- the layout, described once
#: A line of the layout tree naming paths: two spaces of indentation per level, one or more names separated by one
#: space (``name/`` a directory, ``name.py`` a module), then, after two or more spaces, what they hold.
TREE_LINE = re.compile(r"^(?P<indent> *)(?P<names>[\w.]+(?:/|\.py)(?: [\w.]+(?:/|\.py))*)(?: {2,}\S.*)?$")
#: A line indented this far or further continues the description of the line above.
DESCRIPTION_COLUMN = 24
#: A path under ctuq/ written out in the prose of the section.
PROSE_PATH = re.compile(r"\bctuq/(?:\w+/)*(?:\w+\.py|\w+/)?")


def _layout_section() -> str:
    text = DESIGN.read_text(encoding="utf-8")
    m = re.search(r"^## 2\. .*?$(.*?)^## ", text, flags=re.M | re.S)
    assert m, "docs/DESIGN.md has no section '## 2. ...' (the layout)"
    return m.group(1)


def _layout_tree() -> list[tuple[str, int]]:
    """``(path relative to the repository root, line of the tree)`` for every name of the tree in docs/DESIGN.md §2
    (the code block that starts with ``ctuq/``), in order; a directory's path ends in ``/``."""
    blocks = [b for b in re.findall(r"^```\n(.*?)^```", _layout_section(), flags=re.M | re.S) if b.startswith("ctuq/")]
    assert len(blocks) == 1, "docs/DESIGN.md §2 needs one code block that starts with 'ctuq/' (the tree)"
    named: list[tuple[str, int]] = []
    parents: list[str | None] = []  # per depth: the directory the next level lies in (None: not one directory)
    for n, line in enumerate(blocks[0].splitlines(), start=1):
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= DESCRIPTION_COLUMN:
            continue
        m = TREE_LINE.match(line)
        assert m and indent % 2 == 0, f"docs/DESIGN.md §2, tree line {n}: not 'names  what they hold': {line!r}"
        depth = indent // 2
        assert depth <= len(parents), f"docs/DESIGN.md §2, tree line {n}: indented past its parent: {line!r}"
        parent = parents[depth - 1] if depth else ""
        assert parent is not None, f"docs/DESIGN.md §2, tree line {n}: the line above is not one directory: {line!r}"
        names = m["names"].split(" ")
        named += [(parent + name, n) for name in names]
        del parents[depth:]
        parents.append(parent + names[0] if len(names) == 1 and names[0].endswith("/") else None)
    return named


def test_the_layout_names_only_what_exists():
    missing = [
        f"tree line {n}: {path}"
        for path, n in _layout_tree()
        if not ((ROOT / path).is_dir() if path.endswith("/") else (ROOT / path).is_file())
    ]
    missing += [f"prose: {p}" for p in sorted(set(PROSE_PATH.findall(_layout_section()))) if not (ROOT / p).exists()]
    assert not missing, "docs/DESIGN.md §2 names paths that do not exist:\n" + "\n".join(missing)


def test_the_layout_names_every_package_and_module():
    named = {path for path, _ in _layout_tree()}
    have = {
        str(p.relative_to(ROOT)) + ("/" if p.is_dir() else "")
        for p in [*PACKAGE.rglob("*.py"), *(d for d in PACKAGE.rglob("*") if (d / "__init__.py").is_file())]
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    unnamed = sorted(have - named)
    assert not unnamed, "packages and modules of ctuq/ missing from docs/DESIGN.md §2 (add them to the tree):\n" + (
        "\n".join(unnamed)
    )


def test_the_layout_lists_the_top_level_bottom_layer_first():
    top = [
        p.removeprefix("ctuq/").removesuffix("/").removesuffix(".py")
        for p, _ in _layout_tree()
        if p.startswith("ctuq/")
    ]
    top = [name for name in top if "/" not in name and name in LAYER]  # the package's own entries, not configs/
    assert top == sorted(top, key=LAYER.__getitem__), f"docs/DESIGN.md §2: the top level is not in layer order: {top}"
    missing = sorted(set(LAYER) - {"ctuq"} - set(top))
    assert not missing, f"top-level modules and packages missing from docs/DESIGN.md §2: {missing}"
