"""The README and the pages of docs/ point at what exists: every relative link (and its #anchor) at a file or
heading, every repository path they quote at a file or folder, and every ``training_utils`` (or ``tests``) dotted path
at a module that exists, and a name it defines. Nothing is launched."""

import importlib
import re

import pytest

from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
QUOTED = re.compile(r"`([^`]+)`")
REPO_PATH = re.compile(r"^(?:examples|training_utils|tests|docs)/[\w./-]*$")
DOTTED = re.compile(r"(?<![\w/.\[(-])((?:training_utils|tests)(?:\.\w+)+)")
FILE_NAME = re.compile(r"\.(md|py|json|diff|yaml|png|txt)$")


def headings(page):
    """The anchors GitHub gives the headings of ``page``."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in text.splitlines() if line.startswith("#")}


def broken_links(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (linked.suffix != ".md" or anchor not in headings(linked)):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


def missing_paths(page):
    """The repository paths quoted in ``page`` that do not exist (patterns with ``<...>``, ``*`` or ``…`` aside)."""
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    quoted = [text.split()[0] for text in QUOTED.findall(prose) if text.strip()]
    return [path for path in quoted
            if REPO_PATH.match(path) and not any(mark in path for mark in "<*…") and not (REPO / path).exists()]


def module_and_names(dotted):
    """The longest prefix of ``dotted`` that is a module or package file, and the names after it."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:end])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return ".".join(parts[:end]), parts[end:]
    return None, parts


def unresolved_dotted_paths(page):
    unresolved = []
    dotted_paths = {path for path in DOTTED.findall(page.read_text()) if not FILE_NAME.search(path)}  # not a file name
    for dotted in sorted(dotted_paths):
        module, names = module_and_names(dotted)
        if module is None:
            unresolved.append(f"{dotted}: no such module")
            continue
        if names:
            value = importlib.import_module(module)
            for name in names:
                if not hasattr(value, name):
                    unresolved.append(f"{dotted}: {module} defines no {'.'.join(names)}")
                    break
                value = getattr(value, name)
    return unresolved


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_link_and_path_of_the_page_exists(page):
    problems = broken_links(page) + missing_paths(page) + unresolved_dotted_paths(page)
    assert not problems, f"{page.relative_to(REPO)}: " + "; ".join(problems)


def test_the_readme_links_every_page_of_docs():
    linked = {target.partition("#")[0] for target in LINK.findall((REPO / "README.md").read_text())}
    pages = {page.relative_to(REPO).as_posix() for page in PAGES[1:]}
    assert pages <= linked, sorted(pages - linked)


def test_a_broken_link_a_missing_path_and_an_unknown_module_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n```\na stray ` in a code block\n```\n\n"
                    "[gone](no_such_page.md), [here](#a-heading), [nowhere](#no-heading), "
                    "`training_utils/no_such_room/` and `training_utils.no_such_module`, "
                    "`training_utils.errors.no_such_name`; `training_utils/errors.py` and `training_utils.errors`.\n")
    assert broken_links(page) == ["no_such_page.md: no such file", "#no-heading: no heading #no-heading"]
    assert missing_paths(page) == ["training_utils/no_such_room/"]
    assert unresolved_dotted_paths(page) == [
        "training_utils.errors.no_such_name: training_utils.errors defines no no_such_name",
        "training_utils.no_such_module: training_utils defines no no_such_module"]


def test_the_readme_shows_the_memory_plans_estimates_as_docs_memory_has_them():
    """The README's estimate table is docs/memory.md's (which `tests.benchmarks.memory_plan_table` writes), not a copy
    left behind when the plan changes."""
    table = re.compile(r"^\| model \| transformer parameters .*?(?=\n\n|\Z)", re.S | re.M)
    readme, memory = (table.search(page.read_text()) for page in (REPO / "README.md", REPO / "docs" / "memory.md"))
    assert readme is not None and memory is not None
    assert readme.group(0).rstrip() == memory.group(0).rstrip()
