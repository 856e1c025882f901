"""The codec alone: encode and decode against a numpy copy of the same bytes.

No sockets. Identity decoding must be a view (zero-copy): its time is
measured at 1 MiB and at 64 MiB and must not grow with the size. zstd
(level 1, as the client and nodes send by default) is timed both ways and
its ratio taken on realistic activations and on zeros (which compress a
thousandfold and prove nothing: shown so the realistic figure is read
against it). Best of the repeats; the baseline is ``ndarray.copy()``.

Keys: ``identity_decode_us_64mib``, ``zstd_ratio_bf16`` (compressed ÷ raw,
realistic bfloat16), ``zstd_ratio_zeros``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import zstandard

from meshnet_bench.activations import make_activation
from meshnet_proto import WireHeaders, encode_tensor
from meshnet_proto.lowlevel import decode_tensor

from ._result import BenchOptions, SectionResult
from ._support import MiB, mib, rate_mb_s, us

KEYS = ("identity_decode_us_64mib", "zstd_ratio_bf16", "zstd_ratio_zeros")

HIDDEN = 4096


def _best(repeat: int, call: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def _identity_decode_seconds(array: np.ndarray, repeat: int) -> float:
    headers = WireHeaders.for_array(array, encoding="identity")
    body = encode_tensor(array, encoding="identity")
    decoded = decode_tensor(headers, body)
    if not np.shares_memory(decoded, array):
        raise RuntimeError("identity decode copied the body")
    return _best(repeat, lambda: decode_tensor(headers, body))


def run(options: BenchOptions) -> SectionResult:
    zstd_bytes = 1 * MiB if options.tiny else 16 * MiB if options.quick else 64 * MiB
    big = 4 * MiB if options.tiny else 64 * MiB
    repeat = 1 if options.tiny else 3 if options.quick else 5
    options.progress(f"codec: identity decode at 1 MiB and {mib(big)}, zstd on {mib(zstd_bytes)}")
    array = make_activation(zstd_bytes // (HIDDEN * 2), HIDDEN)
    big_array = array if big == zstd_bytes else make_activation(big // (HIDDEN * 2), HIDDEN)
    small = big_array[:, : MiB // (HIDDEN * 2)]
    identity_small = _identity_decode_seconds(small, repeat * 20)
    identity_big = _identity_decode_seconds(big_array, repeat * 20)

    compressor = zstandard.ZstdCompressor(level=1, write_content_size=True)
    decompressor = zstandard.ZstdDecompressor()
    headers = WireHeaders.for_array(array, encoding="zstd")
    packed = encode_tensor(array, encoding="zstd", compressor=compressor)
    if decode_tensor(headers, packed, decompressor=decompressor).tobytes() != array.tobytes():
        raise RuntimeError("zstd round trip lost bits")
    zeros = np.zeros_like(array)
    zeros_packed = encode_tensor(zeros, encoding="zstd", compressor=compressor)

    copy = _best(repeat, array.copy)
    timings = {
        "numpy copy (baseline)": copy,
        "identity encode": _best(repeat, lambda: encode_tensor(array, encoding="identity")),
        "identity decode": _best(
            repeat,
            lambda: decode_tensor(
                headers.replace(encoding="identity"), array.reshape(-1).view(np.uint8).data
            ),
        ),
        "zstd encode (level 1)": _best(
            repeat, lambda: encode_tensor(array, encoding="zstd", compressor=compressor)
        ),
        "zstd decode": _best(
            repeat, lambda: decode_tensor(headers, packed, decompressor=decompressor)
        ),
    }
    ratio_bf16 = len(packed) / array.nbytes
    ratio_zeros = len(zeros_packed) / zeros.nbytes
    result = SectionResult(
        title=f"codec on {mib(array.nbytes)} bfloat16 (no sockets), best of {repeat}",
        keys={
            "identity_decode_us_64mib": round(identity_big * 1e6, 2),
            "zstd_ratio_bf16": round(ratio_bf16, 4),
            "zstd_ratio_zeros": round(ratio_zeros, 6),
        },
    )
    for name, seconds in timings.items():
        result.rows.append(
            {
                "operation": name,
                "time": us(seconds),
                "MB/s": f"{rate_mb_s(array.nbytes, seconds):,.0f}",
                "vs numpy copy": f"{copy / seconds:.2f}x",
            }
        )
    result.notes += [
        f"identity decode: {identity_small * 1e6:.1f} us at 1 MiB, {identity_big * 1e6:.1f} us at "
        f"{mib(big)} (a view: does not grow with the size)",
        f"zstd level 1 size / raw: {ratio_bf16:.3f} on realistic bfloat16 activations, "
        f"{ratio_zeros:.6f} on zeros",
    ]
    return result
