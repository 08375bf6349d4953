"""The docs stay true to the tree and to their readers: docs/architecture.md's package table names every module of
every package and no module that is gone, its layer diagram lists the packages in the order of pyproject.toml's
import-linter contract, and README and docs/ keep their size and speak of no history or machine path."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

DOC = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
# The plugin folders are installed as `vision_grpo.data` and `vision_grpo.rewards` but live at the top.
TOP_LEVEL_PACKAGES = {"data": REPO / "data", "rewards": REPO / "rewards"}


def package_folder(name: str) -> Path:
    return TOP_LEVEL_PACKAGES.get(name, REPO / "vision_grpo" / name)


def package_table() -> dict[tuple[str, ...], set[str]]:
    """Each row of "What each package holds": its packages (the bold names) and the `.py` files its text names."""
    section = DOC.split("## What each package holds", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| **"):
            packages, modules = line.split("|")[1:3]
            rows[tuple(re.findall(r"\*\*(\w+)\*\*", packages))] = set(re.findall(r"`([\w/]+\.py)`", modules))
    return rows


def modules_of(packages: tuple[str, ...]) -> set[str]:
    """The modules of `packages` as the table names them: the path inside the package (`replicas/build.py`)."""
    return {
        str(path.relative_to(package_folder(package)))
        for package in packages
        for path in package_folder(package).rglob("*.py")
        if path.name not in {"__init__.py", "__main__.py"}
    }


def test_the_package_table_names_every_package_and_every_module_and_nothing_else() -> None:
    table = package_table()
    in_tree = {path.parent.name for path in (REPO / "vision_grpo").glob("*/__init__.py")} | set(TOP_LEVEL_PACKAGES)
    assert {package for packages in table for package in packages} == in_tree
    for packages, named in table.items():
        modules = modules_of(packages)
        gone = {name for name in named if name not in modules and not (REPO / name).is_file()}
        assert not gone, f"docs/architecture.md names modules of {packages} that do not exist: {sorted(gone)}"
        unnamed = modules - named
        assert not unnamed, f"docs/architecture.md does not name these modules of {packages}: {sorted(unnamed)}"


def test_the_layer_diagram_is_the_import_contract_in_its_order() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")  # tomllib is 3.11+, we support 3.10
    contract = re.search(r"^layers = \[(.*?)^\]", pyproject, re.S | re.M)[1]
    layers = [
        [name.removeprefix("vision_grpo.") for name in layer.split(" | ")] for layer in re.findall(r'"(.+?)"', contract)
    ]
    diagram = DOC.split("## The packages and their layers", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    drawn = [  # each line: the packages (" | " between), then, four or more spaces on, what they hold
        [name.strip() for name in re.split(r"\s{4,}", line.strip())[0].split("|")]
        for line in diagram.splitlines()
        if line.strip() and not line.strip().startswith(("-", "entry points"))
    ]
    assert drawn == layers


def test_the_docs_stay_within_their_size_and_speak_to_users() -> None:
    """README at most 200 lines and docs/ at most 1,600 in all; no development history or machine paths (those go
    into CHANGELOG.md), as the repository's stop hook greps for them."""
    readme, pages = REPO / "README.md", sorted((REPO / "docs").glob("*.md"))
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 200
    assert sum(len(page.read_text(encoding="utf-8").splitlines()) for page in pages) <= 1600
    history = re.compile(r"/work/|scratch/|\bsession\b|earlier session|\b[Ii]ssue [0-9]{2}\b")
    found = [
        f"{path.name}:{number}: {line}"
        for path in (readme, *pages)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if history.search(line)
    ]
    assert not found, "\n".join(found)
