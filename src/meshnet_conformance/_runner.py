"""Run the cases against a server, and report: a table by section, or JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TextIO

# Each section's cases from its module, not through the package: this module
# is imported by the package's __init__, so ``from . import s2_body`` would
# make the two import each other (tests/repo/test_import_cycles.py).
from ._case import Case, Context
from ._wire import CheckFailed, Target
from .s2_body import CASES as S2_BODY
from .s2_headers import CASES as S2_HEADERS
from .s2_order import CASES as S2_ORDER
from .s3_kv import CASES as S3_KV
from .s3_sample import CASES as S3_SAMPLE
from .s3_sessions import CASES as S3_SESSIONS
from .s3_tenancy import CASES as S3_TENANCY
from .s3_windows import CASES as S3_WINDOWS
from .s4_errors import CASES as S4_ERRORS
from .s5_codecs import CASES as S5_CODECS
from .s6_endpoints import CASES as S6_ENDPOINTS
from .s7_access import CASES as S7_ACCESS

__all__ = ["ALL_CASES", "Outcome", "check_server", "print_json", "print_table"]

ALL_CASES: tuple[Case, ...] = (
    *S2_HEADERS,
    *S2_BODY,
    *S2_ORDER,
    *S3_SESSIONS,
    *S3_KV,
    *S3_SAMPLE,
    *S3_TENANCY,
    *S3_WINDOWS,
    *S4_ERRORS,
    *S5_CODECS,
    *S6_ENDPOINTS,
    *S7_ACCESS,
)

SECTION_TITLES = {
    "2": "the message: headers, framing, body, order of checks",
    "3": "sessions, runs, positions, waiting, replay",
    "4": "errors and deadlines",
    "5": "codecs (the default policies)",
    "6": "control endpoints and routing",
    "7": "access control",
}


@dataclass(frozen=True, slots=True)
class Outcome:
    id: str
    section: str
    description: str
    result: str  # "pass", "fail" or "skip"
    detail: str = ""


def _learn(ctx: Context) -> None:
    """Read /info for the role and the reorder window; a server without it is a node."""
    try:
        response = ctx.send(ctx.request("GET", "/info"))
        info = response.json() if response.status == 200 else {}
    except (CheckFailed, OSError):
        info = {}
    ctx.info = info if isinstance(info, dict) else {}
    if ctx.info.get("role") in ("node", "gateway"):
        ctx.role = ctx.info["role"]


def _run(case: Case, ctx: Context) -> Outcome:
    def outcome(result: str, detail: str = "") -> Outcome:
        return Outcome(case.id, case.section, case.description, result, detail)

    if ctx.role not in case.roles:
        return outcome("skip", f"not for a {ctx.role}")
    if case.needs_token and ctx.token is None:
        return outcome("skip", "needs --token")
    try:
        case.check(ctx)
    except CheckFailed as exc:
        return outcome("fail", str(exc))
    except OSError as exc:
        return outcome("fail", f"{type(exc).__name__}: {exc}")
    return outcome("pass")


def check_server(
    url: str,
    *,
    token: str | None = None,
    role: str | None = None,
    tls_ca: str | None = None,
    timeout: float = 30.0,
    only: Sequence[str] = (),
) -> tuple[Context, list[Outcome]]:
    """Run every case (or those whose id starts with one of ``only``) against ``url``."""
    ctx = Context(Target(url, tls_ca=tls_ca, timeout=timeout), token=token)
    _learn(ctx)
    if role is not None:
        ctx.role = role
    cases = [case for case in ALL_CASES if not only or case.id.startswith(tuple(only))]
    return ctx, [_run(case, ctx) for case in cases]


def _counts(outcomes: Iterable[Outcome]) -> dict[str, int]:
    counts = {"pass": 0, "fail": 0, "skip": 0}
    for outcome in outcomes:
        counts[outcome.result] += 1
    return counts


def print_table(ctx: Context, outcomes: list[Outcome], out: TextIO, seconds: float) -> None:
    print(f"wire-2 conformance of {ctx.target.url} (role {ctx.role})", file=out)
    width = max(len(outcome.id) for outcome in outcomes)
    section = None
    for outcome in outcomes:
        if outcome.section != section:
            section = outcome.section
            print(f"\n§{section} {SECTION_TITLES.get(section, '')}", file=out)
        mark = outcome.result.upper()
        print(f"  {mark:<4}  {outcome.id:<{width}}  {outcome.description}", file=out)
        if outcome.detail and outcome.result == "fail":
            print(f"        {'':<{width}}  -> {outcome.detail}", file=out)
    counts = _counts(outcomes)
    print(
        f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} not applicable "
        f"({seconds:.1f} s)",
        file=out,
    )
    for outcome in outcomes:
        if outcome.result == "fail":
            print(f"FAILED {outcome.id}: {outcome.detail}", file=out)


def print_json(ctx: Context, outcomes: list[Outcome], out: TextIO, seconds: float) -> None:
    document = {
        "target": ctx.target.url,
        "role": ctx.role,
        "counts": _counts(outcomes),
        "seconds": round(seconds, 3),
        "cases": [asdict(outcome) for outcome in outcomes],
    }
    json.dump(document, out, indent=1)
    out.write("\n")


def main(
    url: str,
    *,
    as_json: bool,
    out: TextIO,
    token: str | None = None,
    role: str | None = None,
    tls_ca: str | None = None,
    timeout: float = 30.0,
    only: Sequence[str] = (),
) -> int:
    """What ``meshnet conformance`` does: 0 only when no case failed."""
    start = time.monotonic()
    ctx, outcomes = check_server(
        url, token=token, role=role, tls_ca=tls_ca, timeout=timeout, only=only
    )
    seconds = time.monotonic() - start
    (print_json if as_json else print_table)(ctx, outcomes, out, seconds)
    return 1 if any(outcome.result == "fail" for outcome in outcomes) else 0
