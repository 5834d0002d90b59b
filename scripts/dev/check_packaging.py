#!/usr/bin/env python3
"""Check that setup.cfg ships what the source tree holds (run by `make test`, takes well under a second).

setup.cfg lists packages explicitly (`find:` cannot map the top-level folders patches/ and eval_tasks/
to gear_hf.patches / gear_hf.eval_tasks). An editable install imports a package that is missing from
that list anyway, so the tests would pass while the built wheel lacks it. This script fails when:

* a folder with an __init__.py under gear_hf/, patches/ or eval_tasks/ is not listed (or a listed one
  does not exist);
* a file under eval_tasks/ has an extension that [options.package_data] does not ship.

`--wheel` additionally builds the wheel and checks that every such module and data file is inside it.
"""

from __future__ import annotations

import argparse
import configparser
import fnmatch
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"__pycache__"}


def _lines(value: str) -> list[str]:
    return [x.strip() for x in value.replace(",", "\n").splitlines() if x.strip()]


def read_setup_cfg() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    packages = _lines(cfg.get("options", "packages"))
    package_dir = {}
    for line in _lines(cfg.get("options", "package_dir", fallback="")):
        key, _, value = line.partition("=")
        package_dir[key.strip()] = value.strip()
    data = {k: _lines(v) for k, v in cfg.items("options.package_data")} if cfg.has_section("options.package_data") else {}
    return packages, package_dir, data


def source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools takes `package` from (longest package_dir prefix wins)."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[i:])
    return ROOT / Path(*parts)


def discovered(package_dir: dict[str, str]) -> dict[str, Path]:
    """Every package on disk, named as it will be installed."""
    roots = {"gear_hf": ROOT / "gear_hf"}
    roots.update({name: ROOT / folder for name, folder in package_dir.items()})
    found = {}
    for name, folder in roots.items():
        if not (folder / "__init__.py").is_file():
            continue
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if any(p in SKIP_DIRS or p.startswith(".") for p in rel.parts):
                continue
            dotted = ".".join((name, *rel.parts))
            # a folder mapped elsewhere (gear_hf.patches -> patches/) wins over a same-named subfolder
            if source_dir(dotted, package_dir) == init.parent:
                found[dotted] = init.parent
    return found


def _matches(rel: str, pattern: str) -> bool:
    """setuptools' package_data glob semantics: `*.x` is top level only, `**/*.x` is any depth."""
    if pattern.startswith("**/"):
        return fnmatch.fnmatch(rel.rsplit("/", 1)[-1], pattern[3:])
    return rel.count("/") == pattern.count("/") and fnmatch.fnmatch(rel, pattern)


def data_files(package: str, folder: Path, patterns: list[str]) -> tuple[list[Path], list[Path]]:
    shipped, unshipped = [], []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or any(p in SKIP_DIRS for p in path.relative_to(folder).parts):
            continue
        if path.suffix in (".pyc", ".pyo"):
            continue
        rel = path.relative_to(folder).as_posix()
        ok = any(_matches(rel, pat) for pat in patterns)
        (shipped if ok else unshipped).append(path)
    return shipped, unshipped


def check_wheel(packages: list[str], package_dir: dict[str, str], expected: list[str]) -> list[str]:
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, str(ROOT)],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        names = set(zipfile.ZipFile(wheel).namelist())
    for name in expected:
        if name not in names:
            errors.append(f"the wheel lacks {name}")
    print(f"wheel: {len(names)} files checked against {len(expected)} expected", file=sys.stderr)
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", action="store_true", help="also build the wheel and inspect it")
    args = parser.parse_args()

    packages, package_dir, package_data = read_setup_cfg()
    errors = []
    on_disk = discovered(package_dir)
    for name in sorted(set(on_disk) - set(packages)):
        errors.append(f"package {name} ({on_disk[name].relative_to(ROOT)}/) is not listed in setup.cfg [options] packages")
    for name in packages:
        if not (source_dir(name, package_dir) / "__init__.py").is_file():
            errors.append(f"setup.cfg lists package {name} but {source_dir(name, package_dir).relative_to(ROOT)}/__init__.py does not exist")

    expected = []
    for name in packages:
        folder = source_dir(name, package_dir)
        if not folder.is_dir():
            continue
        prefix = name.replace(".", "/")
        for py in folder.glob("*.py"):
            expected.append(f"{prefix}/{py.name}")
        if name in package_data:
            shipped, unshipped = data_files(name, folder, package_data[name])
            expected += [f"{prefix}/{p.relative_to(folder).as_posix()}" for p in shipped]
            for p in unshipped:
                errors.append(f"{p.relative_to(ROOT)} would not be installed: add its pattern to setup.cfg [options.package_data] {name}")

    if args.wheel and not errors:
        errors += check_wheel(packages, package_dir, sorted(set(expected)))
    for e in errors:
        print(f"check_packaging: {e}", file=sys.stderr)
    if not errors:
        print(f"check_packaging: ok ({len(packages)} packages, {len(set(expected))} files)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
