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
