"""A GraphDef seen as grappler's items: the main graph and each library function's body.

Grappler rewrites the main graph and every reachable function body as separate items
(spec §1.2). ``program_of`` indexes a GraphDef's library once: the functions by name and
position, and their signatures as op definitions (a call node's op is its function's
name). Bodies are built from their FunctionDefs on first use and kept, so the rewrite,
the dump, the command, the loop tools and the oracle each build an item at most once.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from tensorflow.core.framework import function_pb2, graph_pb2, op_def_pb2

from amp_rewrite.core import functions, support

MAIN_GRAPH = ""  # the item name of the main graph (decisions' and stats' ``function``)


@dataclass(frozen=True)
class Program:
    """The items of one GraphDef. Nothing here copies or changes ``graph_def``: the bodies
    ``item`` returns are shared, so read them, or copy before changing one."""

    graph_def: graph_pb2.GraphDef
    library: Mapping[str, function_pb2.FunctionDef]  # function name -> FunctionDef, library order
    positions: Mapping[str, int]                     # function name -> index in graph_def.library.function
    op_defs: Mapping[str, op_def_pb2.OpDef]          # function name -> its signature, for call nodes
    _bodies: dict[str, graph_pb2.GraphDef] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        """Every item: the main graph, then the functions in library order."""
        return (MAIN_GRAPH, *self.library)

    def item(self, name: str) -> graph_pb2.GraphDef:
        """The main graph (``MAIN_GRAPH``) or a function's body as a GraphDef with
        ``_Arg``/``_Retval`` nodes (``functions.body_graph_def``)."""
        if name == MAIN_GRAPH:
            return self.graph_def
        body = self._bodies.get(name)
        if body is None:
            body = self._bodies[name] = functions.body_graph_def(self.library[name], self.op_defs)
        return body

    def put(self, output: graph_pb2.GraphDef, name: str, body: graph_pb2.GraphDef, *,
            control_outputs: Sequence[str] = ()) -> None:
        """Write item ``name``'s new ``body`` into ``output`` (a copy of ``graph_def``): the
        main graph's nodes, or the function's FunctionDef rebuilt at its place in the library.
        ``control_outputs``: more of a function's nodes that run whenever it does, though
        nothing reads them (a main graph has none: a run names what it runs)."""
        if name == MAIN_GRAPH:
            if control_outputs:
                raise ValueError("the main graph has no control outputs; a run names the nodes it runs")
            del output.node[:]
            output.node.extend(body.node)
        else:
            rewritten = functions.to_function_def(body, self.library[name], self.op_defs)
            for node in control_outputs:
                rewritten.signature.control_output.append(node)
                rewritten.control_ret[node] = node
            output.library.function[self.positions[name]].CopyFrom(rewritten)


def program_of(graph_def: graph_pb2.GraphDef) -> Program:
    """Index ``graph_def``'s library; bodies are built when first asked for."""
    library = {function.signature.name: function for function in graph_def.library.function}
    positions = {function.signature.name: index for index, function in enumerate(graph_def.library.function)}
    return Program(graph_def, MappingProxyType(library), MappingProxyType(positions),
                   MappingProxyType(support.library_op_defs(graph_def.library)))
