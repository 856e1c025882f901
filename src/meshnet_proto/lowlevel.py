"""The second tier of meshnet_proto: what a node or gateway builds on beyond
the embedder's loop.

The top level (``meshnet_proto``) is what an embedder writing a wire-2 server
or client needs. A driver that goes further — a gateway that chunks and
reassembles, a node that budgets the bytes requests hold, relays a body
without decoding it, or walks the chain's deep health — takes these too, as
meshnet's runtime, node and gateway do (the same way ``trio.lowlevel`` sits
beside ``trio``). Typed and documented in docs/core-api.md like the top level.
"""

from ._budget import ByteBudget, request_cost
from ._chunking import ChunkAssembler, plan_chunks
from ._client_sessions import Lease
from ._codec import body_bound, decode_tensor
from ._credentials import CLIENT_PATHS, TENANT_NAME, Credentials, HeadCheck, Principal, key_digest
from ._dtypes import WIRE_DTYPES, wire_dtype_name
from ._headers import parse_session_key
from ._kv import KV_RANK, kv_checksum
from ._node_control import NodeControl, answer_headers, stub_identity
from ._policy import apply_wire_dtype
from ._prefix import PREFIX_BLOCK_TOKENS, blocks_ending_in, prefix_block_keys
from ._routing import KEPT_WINDOWS
from ._sample import MAX_ALLOW_MASK_BYTES, MAX_ALLOW_VALUE, MAX_SAMPLE_LOGPROBS, SampleSpec
from ._sequencer import Ticket
from ._server import DEFAULT_MAX_ENDPOINT_BODY, DEFAULT_ROUTES
from ._topology import ChainProblem, StageIdentity, StageReport, is_deep_health
from ._windows import MAX_DRAFT, AfterSpec

__all__ = [
    # a server's memory: what a request will hold, reserved from its head
    "ByteBudget",
    "request_cost",
    # bodies: their bound on the wire, decoding one a connection did not
    "body_bound",
    "decode_tensor",
    "WIRE_DTYPES",
    "wire_dtype_name",
    "apply_wire_dtype",
    # the server's routes and the cap on a control body
    "DEFAULT_ROUTES",
    "DEFAULT_MAX_ENDPOINT_BODY",
    # sessions: a session key's grammar, what the tables hand out
    "parse_session_key",
    "Ticket",
    "Lease",
    # the prefix cache's block keys (wire-2 §3.10)
    "PREFIX_BLOCK_TOKENS",
    "prefix_block_keys",
    "CLIENT_PATHS",
    "TENANT_NAME",
    "HeadCheck",
    "Credentials",
    "Principal",
    "key_digest",
    "blocks_ending_in",
    # the KV hand-off message (wire-2 §3.11)
    "KV_RANK",
    "kv_checksum",
    # sampling at the last stage (wire-2 §3.13)
    "SampleSpec",
    "MAX_ALLOW_MASK_BYTES",
    "MAX_ALLOW_VALUE",
    "MAX_SAMPLE_LOGPROBS",
    # verify windows and rewinds (wire-2 §3.16)
    "AfterSpec",
    "MAX_DRAFT",
    "KEPT_WINDOWS",
    # what a node answers beside its stage: head checks, answer headers, endpoints
    "NodeControl",
    "answer_headers",
    "stub_identity",
    # the gateway's chunking
    "plan_chunks",
    "ChunkAssembler",
    # the chain check's values (wire-2 §6.2)
    "is_deep_health",
    "StageIdentity",
    "StageReport",
    "ChainProblem",
]
