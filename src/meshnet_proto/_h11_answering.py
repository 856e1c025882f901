"""h11's server connection, without checking an answer's headers twice.

h11 rebuilds every response it sends (``_clean_up_response_headers_for_sending``)
so it can add ``Transfer-Encoding: chunked`` or ``Connection: close``, and the
rebuild runs its header regular expressions over every name and value again,
even when it changes nothing. A decode step's answer has ten headers: the
rebuild was ~3 us of it (section decode of docs/performance.md).

The subclass skips the rebuild exactly when it would change nothing: the
answer is framed by ``Content-Length`` (or has no body) and the connection
stays open. Then h11's rebuild only lowercases the names — HTTP names are
case-insensitive, and this sends them as given. Every other answer takes
h11's own path. h11 < 0.17 is pinned; tests/proto holds the bytes sent to
h11's own, names compared without case.
"""

from __future__ import annotations

import h11
from h11._connection import _body_framing

__all__ = ["AnsweringH11"]


class AnsweringH11(h11.Connection):
    """`h11.Connection` for the server role; see the module docstring."""

    def _clean_up_response_headers_for_sending(self, response: h11.Response) -> h11.Response:
        method = self._request_method
        # As h11 decides it: a HEAD answer is framed as a GET's would be.
        framing, _ = _body_framing(b"GET" if method == b"HEAD" else method, response)  # type: ignore[arg-type]
        if framing == "content-length" and self._cstate.keep_alive:
            return response  # already checked when it was built
        return super()._clean_up_response_headers_for_sending(response)
