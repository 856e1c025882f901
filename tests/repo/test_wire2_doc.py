"""docs/wire-2.md is the contract in the repository: stable sections, every code, no outside link.

Code and tests cite "SPEC §n" for sections 1-9, so those numbers must keep
their meaning; every error code the servers can answer must be in the spec;
the conformance checker's sections must be the spec's; and nothing in the
repository may point at the contract's old home outside it.
"""

from __future__ import annotations

import re
from pathlib import Path

from meshnet_conformance import ALL_CASES
from meshnet_proto import ErrorCode

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "docs" / "wire-2.md").read_text(encoding="utf-8")

# The original contract's top-level sections, which "SPEC §n" citations mean.
STABLE = {
    1: "Topology",
    2: "A wire-2 message",
    3: "Sessions and chunk sequencing",
    4: "Errors",
    5: "Codecs",
    6: "Other endpoints",
    7: "Access control",
    8: "Transports",
    9: "Flags every server takes",
}


def headings() -> dict[str, str]:
    return dict(re.findall(r"^##+ (\d+(?:\.\d+)?)\. (.+)$", SPEC, flags=re.MULTILINE))


def test_sections_1_to_9_keep_their_numbers_and_meaning() -> None:
    found = headings()
    for number, title in STABLE.items():
        assert found[str(number)].startswith(title), (number, found.get(str(number)))


def test_every_conformance_case_names_a_section_of_the_spec() -> None:
    found = headings()
    assert {case.section for case in ALL_CASES} <= set(found)
    assert len({case.id for case in ALL_CASES}) == len(ALL_CASES)


def test_every_error_code_the_servers_answer_is_in_the_spec() -> None:
    codes: set[str] = set()
    for path in (ROOT / "src").rglob("*.py"):
        if "openai" in path.parts:  # the OpenAI API's own codes: outside wire 2 (§6)
            continue
        text = path.read_text(encoding="utf-8")
        codes |= set(re.findall(r'code="([a-z0-9_]+)"', text))
        # Raise sites name an ErrorCode member (issue 42): its value is the code.
        codes |= {ErrorCode[name].value for name in re.findall(r"ErrorCode\.([A-Z0-9_]+)", text)}
    assert len(codes) > 30
    missing = sorted(code for code in codes if f"`{code}`" not in SPEC)
    assert missing == []


# Spelt in two pieces so that `grep -rn` for the old path finds nothing, here included.
OLD_HOME = "shared/" + "SPEC"


def test_nothing_points_outside_the_repository_for_the_contract() -> None:
    offenders = []
    for folder in ("src", "tests", "docs", "examples", "fuzz", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            text_file = path.suffix in (".py", ".md", ".txt", ".toml") and path.is_file()
            if text_file and OLD_HOME in path.read_text(encoding="utf-8", errors="replace"):
                offenders.append(str(path.relative_to(ROOT)))
    for name in ("README.md", "pyproject.toml"):
        if OLD_HOME in (ROOT / name).read_text(encoding="utf-8"):
            offenders.append(name)
    assert offenders == []
