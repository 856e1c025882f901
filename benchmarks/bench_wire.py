"""Wire 2 (identity, zstd) against wire 1 (base64 inside JSON): bytes and codec time.

    .venv/bin/python benchmarks/bench_wire.py [--big-tokens 512] [--repeat 5]

Both formats run side by side in this process on the same tensors; the
figures printed are ratios against wire 1 (the baseline), so they carry over
between machines better than absolute times. Time = encode + decode of the
body, best of ``--repeat`` runs; no HTTP, no sockets: this is what the format
itself costs. The data is a seeded bfloat16 activation (see ``meshnet demo``).
"""

from __future__ import annotations

import argparse
import base64
import json
import time
from collections.abc import Callable

import numpy as np
import zstandard

from meshnet_cli.demo import make_activation
from meshnet_proto import WireHeaders, decode_tensor, encode_tensor


def best(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def wire1_body(array: np.ndarray) -> bytes:
    """US-002's format: the tensor's bytes base64-encoded inside a JSON object."""
    document = {
        "shape": list(array.shape),
        "dtype": "bfloat16",
        "data": base64.b64encode(array.tobytes()).decode("ascii"),
    }
    return json.dumps(document).encode()


def wire1(array: np.ndarray) -> tuple[int, Callable[[], object]]:
    def round_trip() -> np.ndarray:
        doc = json.loads(wire1_body(array))
        raw = base64.b64decode(doc["data"])
        return np.frombuffer(raw, dtype=array.dtype).reshape(doc["shape"])

    return len(wire1_body(array)), round_trip


def wire2(array: np.ndarray, encoding: str) -> tuple[int, Callable[[], object]]:
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=True)
    decompressor = zstandard.ZstdDecompressor()
    headers = WireHeaders.for_array(array, encoding=encoding)

    def round_trip() -> np.ndarray:
        body = encode_tensor(array, encoding=encoding, compressor=compressor)
        headers.to_pairs()
        return decode_tensor(headers, body, decompressor=decompressor)

    body = encode_tensor(array, encoding=encoding, compressor=compressor)
    out = decode_tensor(headers, body, decompressor=decompressor)
    assert bytes(out.view(np.uint8)) == bytes(array.view(np.uint8)), "round trip lost bits"
    return len(body), round_trip


def bench(shape: tuple[int, ...], repeat: int) -> None:
    array = make_activation(shape[1], shape[2])
    raw = array.nbytes
    base_bytes, base_fn = wire1(array)
    base_time = best(repeat, base_fn)
    print(f"\n{shape[0]}x{shape[1]}x{shape[2]} bfloat16, {raw / 2**20:.1f} MiB raw")
    print(f"  {'format':<24}{'body bytes':>14}{'vs raw':>8}{'vs wire 1':>11}"
          f"{'enc+dec':>11}{'time vs wire 1':>16}")  # fmt: skip
    rows = [("wire 1 (base64 JSON)", base_bytes, base_time)]
    for encoding in ("identity", "zstd"):
        size, fn = wire2(array, encoding)
        rows.append((f"wire 2 {encoding}", size, best(repeat, fn)))
    for name, size, seconds in rows:
        print(
            f"  {name:<24}{size:>14,}{size / raw:>7.2f}x{size / base_bytes:>10.2f}x"
            f"{seconds * 1000:>9.2f}ms{seconds / base_time:>15.3f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--big-tokens",
        type=int,
        default=512,
        help="tokens of the 16384-wide tensor (2048 = the story's 64 MiB)",
    )
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("wire 2 vs wire 1: body bytes and encode+decode time, best of", args.repeat)
    bench((1, 128, 4096), args.repeat)
    bench((1, args.big_tokens, 16384), args.repeat)


if __name__ == "__main__":
    main()
