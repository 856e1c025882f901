"""What a node serves (wire-2 §6.1) and the check that a chunk is meant for it (§3.2 step 0).

The identity is fixed for the process's life, so it is computed once: the
stage's own fields, the wire settings, and a fingerprint over them, which
the chain check compares across hops. A stage with layers also has a stage
key, ``(model, first layer, stop layer)``: what ``X-Meshnet-Stage`` is
checked against on the way in and what it says on the way down.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from meshnet_proto import ErrorCode, MeshnetError, WireHeaders

from .backends import StageBackend

__all__ = ["StageKey", "check_stage", "node_identity", "stage_key"]

# (model, first layer, stop layer) of a stage with layers.
StageKey = tuple[str, int, int]


def node_identity(stage: StageBackend, wire_dtype: str, encoding: str) -> dict[str, Any]:
    """The ``identity`` of a node's ``/info`` (wire-2 §6.1): the stage's
    fields, the wire settings, and the fingerprint over all of them.
    """
    fields = dict(stage.identity())
    fields.pop("fingerprint", None)
    fields["wire_dtype"] = wire_dtype
    fields["encoding"] = encoding
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
    return {"fingerprint": digest, **fields}


def stage_key(identity: dict[str, Any]) -> StageKey | None:
    """``(model, start, stop)`` from the node's identity, when it has layers."""
    layers = identity.get("layers")
    if layers is None:
        return None
    start, stop = layers
    key = (str(identity["model"]), int(start), int(stop))
    # A model id X-Meshnet-Stage cannot carry is a bug of the stage: say so
    # at start, not on every chunk.
    WireHeaders(shape=(1,), dtype="int32", stage=f"{key[0]}/{key[2]}")
    return key


def check_stage(key: StageKey | None, expected: str) -> None:
    """409 ``stage_mismatch`` unless this node is the stage the sender
    expects to enter (wire-2 §3.2 step 0): checked before anything about
    the chunk, so a chunk meant for another stage changes nothing here."""
    if key is not None and expected == f"{key[0]}/{key[1]}":
        return
    here = (
        "a stage without layers (a stub)"
        if key is None
        else f"{key[0]}/{key[1]} (layers {key[1]}:{key[2]})"
    )
    raise MeshnetError(
        f"x-meshnet-stage: the sender expects stage {expected}, this node is {here}",
        code=ErrorCode.STAGE_MISMATCH,
        header="x-meshnet-stage",
    )
