"""The package layering, read from the source with `ast`: no package imports one its layer forbids, and no two
modules import each other, directly or round a circle. Every import counts: at the top, inside functions, under
TYPE_CHECKING; relative imports are resolved. The checker is also run on a synthetic tree that breaks both rules."""
from __future__ import annotations

import ast
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("model", "parallel", "data", "train", "evals", "configs", "common")
# package -> the packages it must not import (model is the lowest layer with common; train the application).
FORBIDDEN = {
    "model": ("train", "data", "evals"),
    "data": ("model", "train", "evals"),
    "parallel": ("train", "model"),
    "evals": ("train",),
    "configs": ("data", "train", "evals"),
}


def module_files(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path]:
  """{dotted module name: file} of every .py under the packages (a package's own name for its __init__.py)."""
  out = {}
  for package in packages:
    for path in sorted((root / package).rglob("*.py")):
      parts = list(path.relative_to(root).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      out[".".join(parts)] = path
  return out


def _longest_known(name: str, known) -> str | None:
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    if ".".join(parts[:i]) in known:
      return ".".join(parts[:i])
  return None


def _parse(path: pathlib.Path) -> ast.AST:
  """ast.parse, retried: CPython 3.11's parser can raise "SystemError: AST constructor recursion depth mismatch"
  when another thread of the process parses at the same time (python/cpython#106905; seen once in a pytest
  worker that had run checkpointing tests); the file itself parses."""
  for attempt in range(3):
    try:
      return ast.parse(path.read_text(), str(path))
    except SystemError:
      if attempt == 2:
        raise
  raise AssertionError("unreachable")


def _imported_names(module: str, path: pathlib.Path):
  """Every dotted name an import statement in the file reaches (relative imports resolved)."""
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(_parse(path)):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
      else:
        base = node.module or ""
      # `from a import b` is a.b when that is a module, else a name in a (which resolves to a itself).
      yield from (base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)


def import_graph(root: pathlib.Path, packages=PACKAGES) -> dict[str, set[str]]:
  """{module: the project modules it imports} (a name resolves to its longest known module prefix)."""
  files = module_files(root, packages)
  graph = {}
  for module, path in files.items():
    targets = {_longest_known(name, files) for name in _imported_names(module, path)}
    graph[module] = {t for t in targets if t and t != module}
  return graph


def layer_violations(graph: dict[str, set[str]], forbidden=None) -> list[str]:
  """'importer -> imported' for every import of a package the importer's layer forbids."""
  forbidden = FORBIDDEN if forbidden is None else forbidden
  return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                if t.split(".")[0] in forbidden.get(m.split(".")[0], ()))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
  index, low, on_stack, stack, components = {}, {}, set(), [], []
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph.get(start, ()))))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.get(child, ())))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        if len(component) > 1:
          components.append(sorted(component))
  return sorted(components)


def test_no_package_imports_a_layer_it_must_not():
  assert layer_violations(import_graph(REPO)) == []


def test_no_import_circles():
  assert import_cycles(import_graph(REPO)) == []


def test_the_graph_sees_every_kind_of_import():
  """The checks are only as good as the graph: lazy, relative and package-level imports are all in it."""
  graph = import_graph(REPO)
  assert len(graph) > 100
  assert "data.denoise" in graph["data.config_checks"]  # inside a function
  assert "data.config_checks" in graph["data"]  # a package's __init__.py
  assert "model.dense" in graph["model.moe"] and "model.dense" in graph["model.layers"]


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
  for name, text in files.items():
    path = root / name
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(text)


def test_the_checker_reports_a_forbidden_import_and_a_circle(tmp_path):
  """A synthetic tree: model imports train inside a function, configs imports evals under TYPE_CHECKING, and two
  data modules import each other (one relatively, inside a function); all three are reported."""
  _write(tmp_path, {
      "model/__init__.py": "",
      "model/a.py": "def f():\n  from train import t\n  return t\n",
      "train/__init__.py": "",
      "train/t.py": "import model.a\n",
      "configs/__init__.py": "",
      "configs/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from evals import e\n"),
      "evals/__init__.py": "",
      "evals/e.py": "",
      "data/__init__.py": "",
      "data/x.py": "from data import y\n",
      "data/y.py": "def g():\n  from . import x\n  return x\n",
  })
  graph = import_graph(tmp_path, ("model", "train", "configs", "evals", "data"))
  assert layer_violations(graph) == ["configs.c -> evals.e", "model.a -> train.t"]
  assert import_cycles(graph) == [["data.x", "data.y"], ["model.a", "train.t"]]
  assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
