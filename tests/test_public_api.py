"""The code uses the public APIs of JAX and the other libraries only: no `jax._src`, no
underscored attribute of a library's object (what a JAX upgrade may change without notice)."""

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
# Underscored names that are public by convention: NamedTuple's methods, os._exit.
CONVENTIONAL = {"_replace", "_asdict", "_fields", "_make", "_exit"}
PRIVATE_MODULE = re.compile(r"\b(jax|jaxlib|flax|optax|orbax)(\.\w+)*\._\w")


def source_files() -> list[pathlib.Path]:
  """The repository's Python files, tests excluded."""
  skip = {"tests", ".git", ".venv", "build"}
  return [p for p in sorted(REPO.rglob("*.py")) if not skip & set(p.relative_to(REPO).parts[:-1])]


def own_private_names(trees) -> set[str]:
  """Underscored names this repository defines (functions, classes, attributes it assigns)."""
  names = set()
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
        names.add(node.name)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        names.add(node.attr)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        names.add(node.id)
  return {n for n in names if n.startswith("_")}


def private_uses(files) -> list[str]:
  trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in files}
  own = own_private_names(trees.values()) | CONVENTIONAL
  found = []
  for path, tree in trees.items():
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    for node in ast.walk(tree):
      text = None
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        module = getattr(node, "module", None) or ""
        names = [module] + [f"{module}.{a.name}" for a in node.names] + [a.name for a in node.names]
        if any(PRIVATE_MODULE.search(n) for n in names):
          text = ast.unparse(node)
      elif isinstance(node, ast.Attribute):
        attr = node.attr
        dunder = attr.startswith("__") and attr.endswith("__")
        if attr.startswith("_") and not dunder and attr not in own:
          text = ast.unparse(node)
        elif PRIVATE_MODULE.search(ast.unparse(node)):
          text = ast.unparse(node)
      if text:
        found.append(f"{where}:{node.lineno}: {text}")
  return found


def test_no_private_jax_api_in_the_repository():
  files = source_files()
  assert len(files) > 30 and any(p.name == "decode.py" for p in files)
  assert private_uses(files) == []


def test_the_check_finds_private_uses(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text(
      "import jax\n"
      "from jax._src import xla_bridge\n"
      "f = jax.jit(abs)\n"
      "n = f._cache_size()\n"
      "e = jax._src.config\n"
      "x = program._executable._unloaded_executable\n"
      "ok = state._replace(step=1)\n"
  )
  lines = {int(line.split(": ", 1)[0].rsplit(":", 1)[1]) for line in private_uses([bad])}
  assert lines == {2, 4, 5, 6}  # not line 7: NamedTuple's _replace is public
