"""Wire dtype tokens and the numpy dtypes they stand for (wire-2 §2).

Every wire dtype is little-endian whatever the host: the mapping below pins
the byte order explicitly so a big-endian machine still speaks the same wire.
``bfloat16`` comes from ml_dtypes — numpy has no native bfloat16 — and is the
upper half of an IEEE float32, which is what every accelerator means by it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

import ml_dtypes
import numpy as np

__all__ = ["WIRE_DTYPES", "wire_dtype_name"]

WIRE_DTYPES: Mapping[str, np.dtype] = MappingProxyType(
    {
        "float32": np.dtype("<f4"),
        "float16": np.dtype("<f2"),
        "bfloat16": np.dtype(ml_dtypes.bfloat16).newbyteorder("<"),
        "int32": np.dtype("<i4"),
    }
)

# Each wire dtype's token, found by the dtype itself. Equal dtypes hash
# equal, so a native-order "=f4" finds "float32" as well; only numpy's dtype
# objects are looked up (a str or a scalar type goes the long way).
_NAME_OF: Mapping[np.dtype, str] = MappingProxyType({dt: name for name, dt in WIRE_DTYPES.items()})
_WIRE_DTYPE_TYPES = frozenset(type(dt) for dt in WIRE_DTYPES.values())

# The encodings a body may carry (wire-2 §2). Lives here, beside the dtypes,
# because both are "tokens": the header parser and the codec share them.
WIRE_ENCODINGS: frozenset[str] = frozenset({"identity", "zstd"})

# "Well-formed token" (docs/core-api.md): a lowercase token some peer might
# legitimately send us. Well-formed but unknown is 415 (we do not support it),
# anything else is 400 (it is not a token at all).
WELL_FORMED_TOKEN = re.compile(rb"[a-z][a-z0-9_-]{0,31}")


def wire_dtype_name(dtype: np.dtype | type | str) -> str:
    """The wire token for ``dtype``, whatever its byte order.

    A big-endian float32 is still ``"float32"``: the codec swaps it to
    little-endian on the way out. Raises ``ValueError`` for any dtype that is
    not a wire dtype (float64, int8, bool, structured…).
    """
    # The usual case at once: a wire dtype itself, as every decoded tensor's
    # is (np.dtype() and .name cost ~1.5 us; an encoded answer asks this).
    if type(dtype) in _WIRE_DTYPE_TYPES and (name := _NAME_OF.get(dtype)) is not None:  # type: ignore[arg-type]
        return name
    dt = np.dtype(dtype)
    little = dt.newbyteorder("<")
    for name, wire in WIRE_DTYPES.items():
        if little == wire:
            return name
    raise ValueError(
        f"dtype {dt} is not a wire dtype (supported: {', '.join(WIRE_DTYPES)}); "
        "convert it first, e.g. with apply_wire_dtype()"
    )
