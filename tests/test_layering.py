"""The package's imports run one way, down the README's Layout: spec -> codegen -> runtime ->
ops / kernels -> lowering -> packaged_model -> the entry points (torch_ops, dynamo, packaging).
Read from the sources (every import, including those inside functions), so a back-edge fails
here before it becomes an import cycle."""
import ast
from pathlib import Path

import kwker

ROOT = Path(kwker.__file__).parent
LAYERS = {"spec": 0, "eager_specs": 0.5, "codegen": 1, "runtime": 2, "ops": 3, "kernels": 3,
          "lowering": 4, "packaged_model": 4.5, "torch_ops": 5, "dynamo": 5, "packaging": 5,
          "__init__": 6}


def _unit(module: str) -> str:
    """``kwker.lowering.build`` -> ``lowering``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, module: str):
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names] if not node.module \
                else [base]
        else:
            continue
        for name in names:
            if name == "kwker" or name.startswith("kwker."):
                yield node.lineno, name


def test_imports_run_one_way():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        src = _unit(module)
        for line, name in _imports(path, module):
            dst = _unit(name)
            if dst not in LAYERS or dst == "__init__" and name == "kwker":
                continue  # ``from kwker import __version__``: the package's metadata
            if LAYERS[dst] > LAYERS[src] or (LAYERS[dst] == LAYERS[src] and dst != src):
                bad.append(f"{module}:{line} imports {name} ({src} -> {dst})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
