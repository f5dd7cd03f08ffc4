"""Every public name is documented: on an API page of the docs site, with the
docstring sections the API pages rely on; every page's Python runs; the versions the
README states are the ones checked."""

import inspect
import pathlib
import re
import tomllib

import equinox as eqx
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import pscan
import pscan.nn

DOCS = pathlib.Path(__file__).parent.parent / "docs"


def public_names():
    for module in (pscan, pscan.nn):
        for name, obj in vars(module).items():
            if name.startswith("_") or inspect.ismodule(obj):
                continue
            yield f"{module.__name__}.{name}", obj


def documented():
    text = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    return set(re.findall(r"^::: ([\w.]+)", text, re.M))


PUBLIC = list(public_names())


@pytest.mark.parametrize("path, obj", PUBLIC, ids=[path for path, _ in PUBLIC])
def test_public_name_is_documented(path, obj):
    assert path in documented(), f"{path} has no `::: {path}` on a docs/api page"
    doc = inspect.getdoc(obj)
    assert doc and len(doc) > 40, f"{path} has no real docstring"
    if isinstance(obj, type) and issubclass(obj, eqx.Enumeration):
        return
    if inspect.isfunction(obj):
        assert "**Arguments:**" in doc and "**Returns:**" in doc, path
    elif isinstance(obj, type):
        takes = [
            p
            for p in inspect.signature(obj).parameters.values()
            if p.kind is not p.VAR_KEYWORD and p.kind is not p.VAR_POSITIONAL
        ]
        if takes:
            assert "**Arguments:**" in doc or "**Attributes:**" in doc, path
        # the methods users implement or call are documented too
        for name, member in vars(obj).items():
            if inspect.isfunction(member) and not name.startswith("_"):
                mdoc = inspect.getdoc(member)
                assert mdoc and "**Returns:**" in mdoc, f"{path}.{name}"


def test_docs_pages_in_nav_exist():
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    for page in re.findall(r":\s+([\w/]+\.md)", nav):
        assert (DOCS / page).exists(), page


# Every page with Python blocks, and the README: the blocks run in order, as a reader
# follows them, at the sizes printed.
ROOT = DOCS.parent
RUNNABLE = sorted(
    str(path.relative_to(ROOT))
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]
    if "```python" in path.read_text()
)


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(), re.M | re.S)


def test_every_page_with_python_runs():
    assert {"README.md", "docs/index.md", "docs/guides/batches.md"} <= set(RUNNABLE)


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_snippets_run(page):
    """Every Python block of the page, in order, in one namespace: every name a block
    uses is defined on the page."""
    blocks = python_blocks(page)
    assert blocks, page
    namespace = {"__name__": page}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{page} block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page}, block {i + 1} failed:\n{block}") from e


def test_lowest_pins_are_the_declared_bounds():
    """`.ci/lowest.txt` (what `bash .ci/lowest` checks) pins every direct dependency,
    extras included, at exactly the lower bound that pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for line in project["dependencies"] + sum(
        project["optional-dependencies"].values(), []
    ):
        req = Requirement(line)
        if req.name == "pscan":  # an extra that includes another
            continue
        bounds = [s.version for s in req.specifier if s.operator == ">="]
        assert len(bounds) == 1, f"{line}: one lower bound (>=) per dependency"
        declared[req.name] = Version(bounds[0])  # 2.0 == 2.0.0
    pins = {}
    for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name] = Version(spec.version)
    assert pins == declared
