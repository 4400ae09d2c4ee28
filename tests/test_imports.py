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
# The generic code: it names no task (a task lives in tasks/ and is chosen by config.task).
GENERIC = ("model", "decoding", "training", "runs", "data", "parallel")
# Words of the parsing task: its switches, its modules, its scorer.
PARSING_WORDS = re.compile(
    r"\bptb\b|word_set|word_classes|word_dropout|word_chars|word_affixes|word_loss|tree_constraint"
    r"|tree_words|tree_order|tree_closing|\bevalb\b|\bparsing\b|linearization|treebank",
    re.IGNORECASE,
)


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
  assert "transformer_jax.model.incremental" in graph["transformer_jax.decoding.decode"]


def test_the_generic_code_names_no_task():
  """The model, decoding, training, checkpoints and loading of runs, data and batching, and the
  device code name none of the parsing task's words: what a task needs reaches them through
  the task interface (tasks/base.py)."""
  generic = [
      p for p in PACKAGE.rglob("*.py")
      if p.relative_to(PACKAGE).parts[0] in GENERIC
  ]  # fmt: skip
  assert len(generic) > 20
  found = [
      f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}"
      for p in generic
      for n, line in enumerate(p.read_text().splitlines(), start=1)
      if PARSING_WORDS.search(line)
  ]
  assert not found, "\n".join(found)
  assert PARSING_WORDS.search("config.parsing.tree_words") and PARSING_WORDS.search(
      "the ptb source"
  )


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
