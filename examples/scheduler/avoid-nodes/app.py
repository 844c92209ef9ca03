# world: scheduler
"""avoid-nodes: a Trellis scheduler plugin in Python, built with componentize-py.

A Filter plugin: nodes labelled `trellis.dev/avoid: REASON` take only pods annotated
with the same `trellis.dev/avoid: REASON`. It keeps its own view of the nodes' labels,
which the scheduler updates (`update`), and judges each batch of nodes (`filter`)
against the pod of the cycle (`cycle`). `avoid.py` holds the rule.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import log
from wit_world.imports.trellis_scheduler_types import (
    Action, Change_NodeRemove, Change_NodeUpsert, ClusterEvent, Code, ExtensionPoints,
    PermitVerdict_Allow, PluginInfo, Rejection, Status,
)

import avoid


class View:
    """What the plugin keeps between calls. Module state: componentize-py may make a
    new Handler for each call, but the instance (the interpreter) lives on."""
    label = avoid.DEFAULT_LABEL
    # Node labels by node number.
    nodes: dict[int, dict] = {}
    # The value of the label the pod of the cycle accepts.
    accepts: str | None = None


class Handler(exports.Handler):
    def plugins(self, configuration: str):
        try:
            View.label = avoid.parse_configuration(configuration)
        except ValueError as e:
            raise Err(str(e))
        log.log(log.Level.INFO, "avoiding nodes by label", [("label", View.label)])
        return [PluginInfo(
            name="AvoidNodes", points=ExtensionPoints.FILTER, weight=1,
            # A node relabelled may take the pods it turned away.
            events=[ClusterEvent(resource="nodes", action=Action.ADD | Action.UPDATE)])]

    def update(self, changes):
        for change in changes:
            if isinstance(change, Change_NodeUpsert):
                View.nodes[change.value.node] = avoid.node_labels(change.value.object)
            elif isinstance(change, Change_NodeRemove):
                View.nodes.pop(change.value, None)
            # Pods on nodes do not matter to this plugin.

    def cycle(self, pod: str):
        View.accepts = avoid.accepted(json.loads(pod), View.label)
        return []

    def filter(self, nodes):
        out = []
        for node in nodes:
            why = avoid.rejects(View.nodes.get(node, {}), View.label, View.accepts)
            if why is not None:
                out.append(Rejection(node=node, plugin=0,
                                     status=Status(code=Code.UNSCHEDULABLE, reasons=[why])))
        return out

    def filter_without(self, victims, nodes):
        # Pods on nodes do not matter to this plugin: as filter.
        return self.filter(nodes)

    def score(self, nodes):
        return []

    def reserve(self, node):
        return Status(code=Code.SUCCESS, reasons=[])

    def unreserve(self, pod_uid, node):
        pass

    def permit(self, node):
        return PermitVerdict_Allow()

    def allowed(self):
        return []
