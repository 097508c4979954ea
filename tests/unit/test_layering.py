"""The import rules of docs/architecture.md that the packages' names alone do not enforce."""

import ast
import pathlib

import openaligner

SRC = pathlib.Path(openaligner.__file__).parent


def openaligner_imports(path: pathlib.Path) -> set[str]:
    """Every ``openaligner.*`` module that ``path`` imports (at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("openaligner"):
            found |= {
                f"{node.module}.{a.name}" if node.module == "openaligner" else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("openaligner")}
    return found


def test_the_leaves_below_servers_and_trainer_import_nothing_above_them():
    assert openaligner_imports(SRC / "distributed.py") == set()
    for path in (SRC / "io").glob("*.py"):
        assert all(m.startswith("openaligner.io") for m in openaligner_imports(path)), path


def test_nothing_in_trainer_imports_servers():
    for path in (SRC / "trainer").glob("*.py"):
        servers = [m for m in openaligner_imports(path) if m.startswith("openaligner.servers")]
        assert not servers, (path.name, servers)


def test_rollout_sits_between_models_and_trainer():
    """models ← rollout ← trainer / cli: the engines use the actor and the sampling loop, and
    nothing below them knows an engine."""
    above = ("openaligner.trainer", "openaligner.servers", "openaligner.clients", "openaligner.cli")
    for path in (SRC / "rollout").glob("*.py"):
        up = [m for m in openaligner_imports(path) if m.startswith(above)]
        assert not up, (path.name, up)
    for path in [*(SRC / "models").rglob("*.py"), *(SRC / "algorithms").glob("*.py")]:
        engines = [m for m in openaligner_imports(path) if m.startswith("openaligner.rollout")]
        assert not engines, (path.name, engines)


def module_imports() -> dict[str, set[str]]:
    """Every module below ``src/openaligner`` (dotted) → the openaligner modules it imports, at any
    depth of the file (lazy and ``TYPE_CHECKING`` imports too: a circle through them is still one)."""
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for m in openaligner_imports(path):
            while m not in modules and "." in m:  # `from openaligner.x import name` → openaligner.x
                m = m.rsplit(".", 1)[0]
            if m in modules and m != name and path.name != "__init__.py":
                found.add(m)
        graph[name] = found
    return graph


def test_no_modules_import_each_other_in_a_circle():
    graph = module_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = [*path[path.index(nxt) :], nxt]
                raise AssertionError(f"an import circle: {' -> '.join(circle)}")
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def documented_modules() -> set[str]:
    """The files the layout block of docs/architecture.md names, as paths below ``src/openaligner``."""
    import re

    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layout: one home per concern") :]
    block = section.split("```\n")[1]
    named, parents = set(), {0: ""}
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if m is None or not m.group(2).endswith((".py", "/")):
            continue  # a description's continuation line
        depth = len(m.group(1)) // 2
        path = parents[depth] + m.group(2)
        if path.endswith("/"):
            parents[depth + 1] = path
        else:
            named.add(path)
    return named


def test_the_architecture_doc_names_every_module_there_is():
    real = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if p.name != "__init__.py"}
    real.add("cli/demo/__init__.py")  # the demo's recipe lives in its package module
    documented = documented_modules()
    assert not real - documented, f"modules missing from docs/architecture.md: {sorted(real - documented)}"
    assert not documented - real, (
        f"docs/architecture.md names modules that do not exist: {sorted(documented - real)}"
    )


def module_docstrings() -> dict[str, str]:
    """Every module below ``src/openaligner`` → its docstring ("" when it has none)."""
    import ast

    return {
        str(p.relative_to(SRC)): ast.get_docstring(ast.parse(p.read_text()), clean=False) or ""
        for p in sorted(SRC.rglob("*.py"))
    }


def test_every_module_docstring_says_what_it_owns_in_at_most_ten_lines():
    docstrings = module_docstrings()
    missing = [m for m, d in docstrings.items() if not d.strip()]
    assert not missing, f"modules without a docstring: {missing}"
    long = {m: len(d.splitlines()) for m, d in docstrings.items() if len(d.splitlines()) > 10}
    assert not long, (
        f"module docstrings over 10 lines (say what the file owns and must not know; move the "
        f'rationale to its docs/*.md page under "Module notes"): {long}'
    )


def test_a_docstring_that_points_to_module_notes_has_its_section_there():
    import re

    docs = SRC.parents[1] / "docs"
    for module, doc in module_docstrings().items():
        for page in re.findall(r'docs/([\w-]+\.md)[^"]*"Module notes"', " ".join(doc.split())):
            text = (docs / page).read_text()
            assert f"### `{module}`" in text.split("## Module notes", 1)[-1], (module, page)
