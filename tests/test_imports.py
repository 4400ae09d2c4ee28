"""The package's import graph, read from the source with `ast` (nothing is imported): no cycle,
layers that import one way (commands on top; the model below decoding, decoding below the
training loop), and generic code that names no task."""

import ast
import pathlib
import re

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


COMMANDS = (
    "translate", "parse", "export", "average", "sweep", "plot", "plot_attention",
    "tune_decoding", "prepare_data",
)  # fmt: skip
# The generic code: it imports nothing of tasks/ but the registry and names no task (a task
# lives in tasks/, is chosen by config.task and reaches this code through tasks/base.py's Task).
GENERIC = ("model", "decoding", "training", "runs", "data", "parallel", "serving")
GENERIC_MODULES = ("transformer_jax.config",)
REGISTRY = "transformer_jax.tasks"


def _in(module: str, *packages: str) -> bool:
  return any(module == f"transformer_jax.{p}" or module.startswith(f"transformer_jax.{p}.")
             for p in packages)  # fmt: skip


def test_the_package_has_no_import_cycle():
  graph = import_graph()
  assert "transformer_jax.model.transformer" in graph and "transformer_jax.data.tokenizer" in graph
  # The reader finds the edges that exist (so an empty graph cannot pass this test).
  assert "transformer_jax.model.config" in graph["transformer_jax.model.attention"]
  assert "transformer_jax.model.attention" in graph["transformer_jax.model.transformer"]
  assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_layers_import_one_way():
  """Nothing imports a command; the model imports no decoding, training, task or data code;
  decoding imports no training code; tasks import no command and no training loop."""
  graph = import_graph()
  commands = {f"transformer_jax.{c}" for c in COMMANDS}
  assert commands <= set(graph)  # every command is a module at the top
  for module, imported in graph.items():
    assert not imported & commands, (module, imported & commands)
  for module in graph:
    deps = _reachable(graph, module)
    if _in(module, "model"):
      bad = {m for m in deps if _in(m, "decoding", "training", "tasks", "runs", "data")}
      assert not bad, (module, bad)
    if _in(module, "decoding"):
      assert not {m for m in deps if _in(m, "training")}, module
  assert "transformer_jax.model.transformer" not in _reachable(
      graph, "transformer_jax.model.attention"
  )
  # The reader sees the layers it checks (so an empty graph cannot pass).
  assert "transformer_jax.decoding.decode" in graph["transformer_jax.runs.inference"]
  assert "transformer_jax.decoding.decoder" in graph["transformer_jax.decoding.decode"]


def _generic(graph) -> list[str]:
  return [m for m in graph if _in(m, *GENERIC) or m in GENERIC_MODULES]


def test_the_generic_code_imports_nothing_of_a_task():
  """The model, decoding, training, runs, data, device and serving code and config.py import of
  tasks/ the registry alone (tasks/__init__.py, which imports no task): a task's model, loss,
  features or scorer reach them through the Task a run hands down, whatever they are called."""
  graph = import_graph()
  generic = _generic(graph)
  assert len(generic) > 30 and "transformer_jax.config" in generic
  found = {m: sorted(d for d in graph[m] if _in(d, "tasks") and d != REGISTRY) for m in generic}
  assert not {m: d for m, d in found.items() if d}, found
  # The rule sees the edges it forbids (so an empty graph cannot pass): a task imports the generic
  # code, and the registry is what the generic code reaches.
  assert "transformer_jax.model.transformer" in _reachable(
      graph, "transformer_jax.tasks.parsing.chart_model"
  )
  assert REGISTRY in graph["transformer_jax.training.train"]
  assert not {d for d in graph[REGISTRY] if _in(d, "tasks") and d != REGISTRY}


def _string_constants(path: pathlib.Path) -> set[str]:
  return {
      node.value
      for node in ast.walk(ast.parse(path.read_text(), str(path)))
      if isinstance(node, ast.Constant) and isinstance(node.value, str)
  }


def test_the_generic_code_names_no_task():
  """No string of the generic code is a built-in task's name or its config section: no branch
  on `config.task == "parsing"`, no `config.parsing.<key>` read by name."""
  from transformer_jax import tasks

  names = set(tasks.BUILTIN)
  assert names >= {"translation", "parsing"}
  found = {}
  for path in PACKAGE.rglob("*.py"):
    module = _module_name(path)
    if _in(module, *GENERIC) or module in GENERIC_MODULES:
      hits = {s for s in _string_constants(path) if s in names or s.split(".")[0] in names}
      hits = {s for s in hits if s != "translation" or module != "transformer_jax.config"}
      if hits:
        found[module] = sorted(hits)
  # config.py's default task is translation's name (default_config's argument): nothing else.
  assert not found, found
  assert "parsing" in _string_constants(PACKAGE / "tasks" / "parsing" / "task.py")


def test_the_model_config_has_the_fields_the_paper_map_lists():
  """TransformerConfig's fields are those docs/paper_map.md lists (the paper's hyperparameters and
  the deviations any task may use): a task's field added to the generic model fails here."""
  import dataclasses

  from transformer_jax.model.config import TransformerConfig

  text = (PACKAGE.parent / "docs" / "paper_map.md").read_text()
  section = text.split("### TransformerConfig's fields", 1)[1].split("\n## ", 1)[0]
  listed = set(re.findall(r"`(\w+)`", section))
  fields = {f.name for f in dataclasses.fields(TransformerConfig)}
  assert len(fields) > 20 and fields == listed, (fields - listed, listed - fields)


def test_translating_imports_no_parsing_module():
  """The translate command's import closure (function-level imports included) holds no module
  of the parsing task: tasks are imported by name when a run asks for one (tasks/__init__.py)."""
  graph = import_graph()
  closure = _reachable(graph, "transformer_jax.translate")
  assert "transformer_jax.runs.inference" in closure and "transformer_jax.tasks" in closure
  assert not {m for m in closure if _in(m, "tasks.parsing")}, closure
  assert {m for m in _reachable(graph, "transformer_jax.parse") if _in(m, "tasks.parsing")}


def test_the_model_config_imports_no_flax():
  tree = ast.parse((PACKAGE / "model" / "config.py").read_text())
  imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
  assert not {m for m in imported if m.split(".")[0] == "flax"}, imported


def test_pad_id_agrees_with_the_tokenizers():
  from transformer_jax.data import tokenizer
  from transformer_jax.model import config as model_config

  assert model_config.PAD_ID == tokenizer.PAD_ID and model_config.BOS_ID == tokenizer.BOS_ID
