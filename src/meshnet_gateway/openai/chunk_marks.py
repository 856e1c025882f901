"""What a generation's run adds to its chunks' headers on their way out:
the sampling parameters on the last chunk (wire-2 §3.13) and whom the
session serves on every chunk (§3.15)."""

from __future__ import annotations

from collections.abc import Callable

from meshnet_proto import WireHeaders
from meshnet_proto.lowlevel import SampleSpec

from ..tenancy import Tenancy

__all__ = ["marked", "sampling_last"]


def sampling_last(
    annotate: Callable[[WireHeaders], WireHeaders] | None, sample: SampleSpec
) -> Callable[[WireHeaders], WireHeaders]:
    """``annotate``, then ``X-Meshnet-Sample`` on the run's last chunk alone:
    only its answer is used, and an earlier chunk's needs no draw."""

    def with_sample(headers: WireHeaders) -> WireHeaders:
        if annotate is not None:
            headers = annotate(headers)
        if headers.chunk_index == (headers.chunk_total or 1) - 1:
            return headers.replace(sample=sample)
        return headers

    return with_sample


def marked(
    annotate: Callable[[WireHeaders], WireHeaders] | None, tenancy: Tenancy
) -> Callable[[WireHeaders], WireHeaders]:
    """``annotate``, then the tenancy headers (wire-2 §3.15) on every chunk."""
    if annotate is None:
        return tenancy.mark
    return lambda headers: tenancy.mark(annotate(headers))
