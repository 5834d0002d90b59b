"""Layering of the package, read from the source with `ast` (nothing is imported):

* nothing under gear_hf/kernels imports gear_hf.cache, gear_hf.config or gear_hf.format: kernels take tensors, specs
  and numbers; what takes a GearCache layer lives in gear_hf.cache.fused, what decides for a configuration in
  gear_hf.backends;
* gear_hf.config (a value object) imports no runtime: no backend, cache, kernel or transformers;
* no file of gear_hf is longer than MAX_LINES.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gear_hf"
KERNELS = PACKAGE / "kernels"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules a file of the package imports anywhere in it."""
    return modules_imported_by(path.read_text(), _module_name(path), path.name == "__init__.py")


def modules_imported_by(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of the modules `source` (module `module`) imports anywhere in it: relative imports resolved
    against its package; `from a import b` counts as a and a.b; string arguments of importlib.import_module and
    __import__ too."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            names.add(name)
            names.update(f"{name}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def _imports_cache(names: set[str]) -> list[str]:
    return sorted(n for n in names if n == "gear_hf.cache" or n.startswith("gear_hf.cache."))


def test_the_checker_sees_every_form_of_import():
    """Relative, absolute, from-package and importlib forms of an import of the cache are all seen, inside
    functions too; imports of other modules are not taken for it."""
    cases = {"from ...cache import GearCache": True, "from ...cache.layer import x": True,
             "import gear_hf.cache.fused": True, "from gear_hf import cache": True, "from ... import cache": True,
             "importlib.import_module('gear_hf.cache')": True, "from ...compress import gear": False,
             "from .. import views": False, "import gear_hf.cached": False}
    for code, expected in cases.items():
        names = modules_imported_by(f"def f():\n    {code}\n", "gear_hf.kernels.cpu.probe")
        assert bool(_imports_cache(names)) == expected, (code, sorted(names))
    assert _imports_cache(modules_imported_by("from ..cache import x\n", "gear_hf.kernels", is_package=True))


def test_kernels_do_not_import_the_cache():
    offenders = {str(path.relative_to(ROOT)): found for path in sorted(KERNELS.rglob("*.py"))
                 if (found := _imports_cache(imported_modules(path)))}
    assert not offenders, f"gear_hf/kernels must not import gear_hf.cache (move the glue to gear_hf/cache/fused.py): " \
                          f"{offenders}"


def _imports_any(names: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names for p in packages if n == p or n.startswith(p + "."))


def test_kernels_take_no_configuration():
    offenders = {str(path.relative_to(ROOT)): found for path in sorted(KERNELS.rglob("*.py"))
                 if (found := _imports_any(imported_modules(path), ("gear_hf.config", "gear_hf.format")))}
    assert not offenders, f"gear_hf/kernels must not import the configuration or the format: {offenders}"


def test_the_configuration_imports_no_runtime():
    runtime = ("gear_hf.backends", "gear_hf.cache", "gear_hf.kernels", "gear_hf.api", "gear_hf.attention",
               "transformers")
    offenders = {str(path.relative_to(ROOT)): found for path in sorted((PACKAGE / "config").rglob("*.py"))
                 if (found := _imports_any(imported_modules(path), runtime))}
    assert not offenders, f"gear_hf/config must stay a value object: {offenders}"


def test_no_file_longer_than_max_lines():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    offenders = {name: n for name, n in sorted(lengths.items()) if n > MAX_LINES}
    assert not offenders, f"files over {MAX_LINES} lines (split them by responsibility): {offenders}"
