import subprocess
import sys


def test_algorithms_import_no_heavy_modules():
    code = (
        "import sys, openaligner.algorithms as a; "
        "bad = [m for m in ('transformers', 'pytriton', 'tensorboard', 'omegaconf', 'numpy.distutils') "
        "if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_algorithms_source_imports_only_torch_and_stdlib():
    import ast
    import pathlib

    import openaligner.algorithms as pkg

    allowed_roots = {"torch", "openaligner", "__future__"} | set(sys.stdlib_module_names)
    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots = [node.module.split(".")[0]]
                if roots[0] == "openaligner":
                    assert node.module.startswith("openaligner.algorithms"), (path, node.module)
            else:
                continue
            for root in roots:
                assert root in allowed_roots, f"{path.name} imports {root}"
