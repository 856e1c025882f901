"""``meshnet send``: one .npy through a running gateway, one line of summary."""

from __future__ import annotations

import argparse
import sys

import anyio
import ml_dtypes
import numpy as np

from meshnet_gateway import forward_via_gateway
from meshnet_proto import DownstreamError, MeshnetError
from meshnet_proto.lowlevel import WIRE_DTYPES

__all__ = ["load_wire_array", "run_send", "saveable"]

# How `meshnet send` writes OUT.npy (--out-dtype).
OUT_DTYPES = ("float32", "wire")


def load_wire_array(path: str) -> np.ndarray:
    """Load ``path`` as a wire-dtype array.

    numpy cannot name bfloat16 in a .npy header and saves it as 2-byte void
    (``<V2``); such a file is read as bfloat16, the only 2-byte wire dtype
    numpy has no name for.
    """
    array: np.ndarray = np.load(path, allow_pickle=False)
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
        array = array.view(ml_dtypes.bfloat16)
    if not any(array.dtype == dtype for dtype in WIRE_DTYPES.values()):
        wanted = ", ".join(WIRE_DTYPES)
        raise ValueError(f"{path}: dtype {array.dtype} is not a wire dtype ({wanted})")
    if array.ndim == 0 or array.size == 0:
        raise ValueError(f"{path}: shape {array.shape} has no tokens to send")
    return array


def saveable(output: np.ndarray, out_dtype: str) -> np.ndarray:
    """The array to write as OUT.npy.

    A .npy header cannot name bfloat16: numpy writes it as 2-byte void and
    ``np.load`` gives back ``|V2`` bytes nobody can compute with. So by
    default (``float32``) a bfloat16 output is widened to float32 — exact:
    every bfloat16 is a float32 with the low 16 bits zero. ``wire`` writes
    what came over the wire (bfloat16 as ``|V2``; ``meshnet send`` reads such
    a file back as bfloat16). Other dtypes are written as they are.
    """
    array = np.asarray(output)
    if out_dtype == "float32" and array.dtype == ml_dtypes.bfloat16:
        return array.astype(np.float32)
    return array


def run_send(args: argparse.Namespace) -> int:
    try:
        array = load_wire_array(args.input)
    except (OSError, ValueError) as exc:
        print(f"meshnet send: {exc}", file=sys.stderr)
        return 2
    try:
        result = anyio.run(
            lambda: forward_via_gateway(
                args.gateway,
                array,
                session=args.session,
                encoding=args.encoding,
                wire_dtype=args.wire_dtype,
                token=args.token,
                timeout=args.timeout,
                tls_ca=args.tls_ca,
                key=getattr(args, "session_key", None),
            ),
            backend="trio",
        )
    except DownstreamError as exc:
        # Our own connection to the gateway failed: no server answered, so
        # there is no status to report (a "502" would name a server that may
        # not exist).
        hint = "; is a gateway running there?" if exc.code == "downstream_unreachable" else ""
        print(f"meshnet send: {exc.message}{hint}", file=sys.stderr)
        return 1
    except MeshnetError as exc:
        if exc.code == "session_forbidden" and getattr(args, "session_key", None) is None:
            # The gateway minted the session's key and printed it when it was created.
            print("meshnet send: pass the session's key with --session-key", file=sys.stderr)
        return _answered(exc)
    except (OSError, ValueError) as exc:
        print(f"meshnet send: {exc}", file=sys.stderr)
        return 1
    # A key the gateway minted is told once: say it, or the session cannot go on.
    minted = f" key {result.headers.session_key}" if result.headers.session_key else ""
    written = saveable(result.output, args.out_dtype)
    np.save(args.output, written)
    chunk = result.chunks[0]
    shape = "x".join(map(str, result.output.shape))
    print(
        f"sent {shape} {chunk.request.dtype} {chunk.request.encoding} "
        f"({chunk.raw_bytes:,} B raw, {chunk.sent_bytes:,} B on the wire) -> "
        f"{result.headers.dtype} {result.headers.encoding} ({chunk.received_bytes:,} B) "
        f"in {result.seconds * 1000:.1f} ms; session {result.session} "
        f"position {result.position}{minted}; wrote {args.output} ({written.dtype})"
    )
    return 0


def _answered(exc: MeshnetError) -> int:
    """The gateway (or a node behind it) answered an error: say who and what."""
    hop = f" (hop {exc.hop})" if exc.hop else ""
    print(f"meshnet send: {exc.status} {exc.code}{hop}: {exc.message}", file=sys.stderr)
    return 1
