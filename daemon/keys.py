"""The key layout under the cluster prefix. Nothing else builds etcd keys by hand.

    <prefix>/nodes/<node>        node record, bound to the node's lease ("alive")
    <prefix>/registry/<node>     persistent entry: last known state, cordon flag
    <prefix>/drains/<node>       drain request (operator, SIGTERM, cloud notice, health)
    <prefix>/controller          elected controller, bound to its daemon's lease
    <prefix>/events/<id>         events, oldest pruned by the controller
    <prefix>/kv/<namespace>/...  workers' key-value service (process-group bootstrap)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str

    @property
    def nodes(self) -> str:
        return f"{self.prefix}/nodes/"

    def node(self, name: str) -> str:
        return f"{self.nodes}{name}"

    @property
    def registry(self) -> str:
        return f"{self.prefix}/registry/"

    def registry_entry(self, name: str) -> str:
        return f"{self.registry}{name}"

    @property
    def drains(self) -> str:
        return f"{self.prefix}/drains/"

    def drain(self, name: str) -> str:
        return f"{self.drains}{name}"

    @property
    def controller(self) -> str:
        return f"{self.prefix}/controller"

    @property
    def events(self) -> str:
        return f"{self.prefix}/events/"

    def event(self, event_id: str) -> str:
        return f"{self.events}{event_id}"

    def kv(self, namespace: str) -> str:
        return f"{self.prefix}/kv/{namespace}/"

    @staticmethod
    def name_of(key: str, collection: str) -> str:
        """The last path element of ``key`` under ``collection`` (a prefix ending in '/')."""
        return key[len(collection):]
