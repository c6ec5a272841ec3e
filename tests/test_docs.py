"""The docs name what exists: every module of the project (each .py at the root and under its packages) has its line
in docs/architecture.md, every doc the README links to exists, and the README stays short."""

from __future__ import annotations

import os
import re
import subprocess

from conftest import ROOT

PACKAGES = ("api", "core", "text", "guided", "models", "deploy", "scripts")


def project_modules() -> list[str]:
    """Every tracked .py of the project (the root's and its packages'), as a path from the root."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    paths = out.split()
    assert paths, "git ls-files found no module"
    return [p for p in paths if "/" not in p or p.split("/")[0] in PACKAGES]


def test_every_module_is_named_in_the_architecture_doc():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        doc = f.read()
    missing = [p for p in project_modules() if not re.search(rf"(?<![\w/]){re.escape(p)}(?!\w)", doc)]
    assert not missing, f"modules with no line in docs/architecture.md: {missing}"


def test_the_readme_links_exist_and_it_stays_short():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert "docs/architecture.md" in links and "docs/configuration.md" in links, links
    assert [link for link in links if not os.path.exists(os.path.join(ROOT, link))] == []
    assert len(readme.splitlines()) <= 300


def test_no_module_edits_sys_path_to_reach_the_project():
    """The project imports by package path as installed (``pip install -e .``), from anywhere: no module puts the
    checkout on ``sys.path``. The one exception is scripts/convert_hf_to_gguf.py, which puts llama.cpp's vendored
    converter (not a package) there to run it."""
    edits = []
    for path in project_modules() + [f"tests/{name}" for name in os.listdir(os.path.join(ROOT, "tests"))]:
        if not path.endswith(".py") or path == "scripts/convert_hf_to_gguf.py":
            continue
        with open(os.path.join(ROOT, path)) as f:
            edits += [f"{path}: {line.strip()}" for line in f if re.search(r"sys\.path\s*(\.|\[.*\]\s*=|\+?=)", line)]
    assert not edits, edits
