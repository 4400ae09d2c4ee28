"""The package's import graph, read from the source with `ast` (nothing is imported): a tree,
with the model's layers below the model and the model apart from the data pipeline."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "transformer_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
  """module -> the package's modules it imports, at any depth of its code (function-level
  imports count: they run too)."""
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    is_package = path.name == "__init__.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the containing package
          package = name.split(".") if is_package else name.split(".")[:-1]
          package = package[: len(package) - (node.level - 1)]
          base = ".".join(package + ([base] if base else []))
        # `from pkg import mod` imports the module pkg.mod; `from mod import f` imports mod.
        targets = [
            f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
        ]
      else:
        continue
      for target in targets:
        # The module itself, or the nearest enclosing module of the package (pkg.mod.attr).
        while target and target not in modules:
          target = target.rpartition(".")[0]
        if target and target != name:
          imported.add(target)
    graph[name] = imported
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle as [a, b, ..., a], or None."""
  state = {}  # absent: unvisited; 1: on the current path; 2: done

  def visit(node, path):
    state[node] = 1
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return [*path[path.index(nxt) :], nxt]
      if nxt not in state:
        cycle = visit(nxt, [*path, nxt])
        if cycle:
          return cycle
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node, [node])
      if cycle:
        return cycle
  return None


def _reachable(graph, start):
  seen, todo = set(), [start]
  while todo:
    for nxt in graph[todo.pop()] - seen:
      seen.add(nxt)
      todo.append(nxt)
  return seen


def test_the_package_has_no_import_cycle():
  graph = import_graph()
  assert "transformer_jax.model" in graph and "transformer_jax.data.tokenizer" in graph
  # The reader finds the edges that exist (so an empty graph cannot pass this test).
  assert "transformer_jax.model_config" in graph["transformer_jax.attention"]
  assert "transformer_jax.attention" in graph["transformer_jax.model"]
  assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_layers_sit_below_the_model_and_the_model_apart_from_the_data():
  graph = import_graph()
  assert "transformer_jax.model" not in _reachable(graph, "transformer_jax.attention")
  model_deps = _reachable(graph, "transformer_jax.model")
  assert not {m for m in model_deps if m.startswith("transformer_jax.data")}, model_deps


def test_the_model_config_imports_no_flax():
  tree = ast.parse((PACKAGE / "model_config.py").read_text())
  imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
  assert not {m for m in imported if m.split(".")[0] == "flax"}, imported


def test_pad_id_agrees_with_the_tokenizers():
  from transformer_jax import model_config
  from transformer_jax.data import tokenizer

  assert model_config.PAD_ID == tokenizer.PAD_ID
