"""meshnet_node: one stage of a meshnet chain, served over wire 2 (wire-2 §1-§4)."""

from .app import NodeApp
from .backends import BACKENDS, Stage, make_stage
from .serving import RunningNode, build_node, serve_node

__all__ = ["BACKENDS", "NodeApp", "RunningNode", "Stage", "build_node", "make_stage", "serve_node"]
