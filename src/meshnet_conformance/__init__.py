"""``meshnet conformance URL``: wire 2's conformance checker (docs/wire-2.md §10).

Point it at any wire-2 server (a node or a gateway, this project's or
another implementation's): it runs the spec's cases over real sockets, one
module per spec section, and reports pass/fail by section. Exit status 0
only when no case failed.
"""

from ._case import Case, Context
from ._runner import ALL_CASES, Outcome, check_server, main
from ._wire import CheckFailed, Target

__all__ = [
    "ALL_CASES",
    "Case",
    "CheckFailed",
    "Context",
    "Outcome",
    "Target",
    "check_server",
    "main",
]
