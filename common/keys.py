"""The key layout under the cluster prefix. Nothing else builds etcd keys by hand.

    <prefix>/nodes/<node>        node record, bound to the node's lease ("alive")
    <prefix>/registry/<node>     persistent entry: last known state, cordon flag
    <prefix>/drains/<node>       drain request (operator, SIGTERM, cloud notice, health)
    <prefix>/controller          elected controller, bound to its daemon's lease
    <prefix>/events/<id>         events, oldest pruned by the controller
    <prefix>/jobs/<job>/spec     what `understudy run` asked for
    <prefix>/jobs/<job>/assignment   rank -> node, standbys, epoch (controller, CAS)
    <prefix>/jobs/<job>/status   pending | running | done | failed | stopped (controller)
    <prefix>/jobs/<job>/resize   the operator's resize request (`understudy resize`)
    <prefix>/jobs/<job>/stop     the operator's stop request (`understudy stop`)
    <prefix>/jobs/<job>/migration    the job's current or last migration (controller)
    <prefix>/jobs/<job>/rendezvous   a restart-only job's MASTER_ADDR:PORT for an epoch
    <prefix>/jobs/<job>/exits/<epoch>/<rank>   how a rank's process ended (its daemon)
    <prefix>/kv/<namespace>/...  workers' key-value service (process-group bootstrap)
    <prefix>/logs/files/<job>/<rank>/<epoch>-<node>-<pid>   where a rank's process logs (its
                                 daemon, when it starts or renames the process)
    <prefix>/logs/requests/<node>/<id>   `understudy logs` asks node for a file (CLI's lease)
    <prefix>/logs/chunks/<id>/<seq>      the node's answer, chunk by chunk (same lease)
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

    @property
    def jobs(self) -> str:
        return f"{self.prefix}/jobs/"

    def job_spec(self, job: str) -> str:
        return f"{self.jobs}{job}/spec"

    def job_assignment(self, job: str) -> str:
        return f"{self.jobs}{job}/assignment"

    def job_status(self, job: str) -> str:
        return f"{self.jobs}{job}/status"

    def job_resize(self, job: str) -> str:
        """The operator's resize request for the job (``understudy resize``)."""
        return f"{self.jobs}{job}/resize"

    def job_stop(self, job: str) -> str:
        """The operator's stop request for the job (``understudy stop``)."""
        return f"{self.jobs}{job}/stop"

    def job(self, job: str) -> str:
        """Everything the job keeps under ``jobs/`` (``understudy delete`` removes it)."""
        return f"{self.jobs}{job}/"

    def job_migration(self, job: str) -> str:
        """The job's current (or last) migration; one at a time per job."""
        return f"{self.jobs}{job}/migration"

    def job_rendezvous(self, job: str) -> str:
        """Where a restart-only job's ranks of the current epoch meet (rank 0's daemon)."""
        return f"{self.jobs}{job}/rendezvous"

    def rank_exit(self, job: str, epoch: int, rank: int) -> str:
        return f"{self.jobs}{job}/exits/{epoch}/{rank}"

    @property
    def kv_root(self) -> str:
        return f"{self.prefix}/kv/"

    def kv(self, namespace: str) -> str:
        return f"{self.prefix}/kv/{namespace}/"

    @property
    def log_files(self) -> str:
        return f"{self.prefix}/logs/files/"

    def log_files_of(self, job: str) -> str:
        return f"{self.log_files}{job}/"

    def log_file(self, job: str, rank: int, epoch: int, node: str, pid: int) -> str:
        """Sorted by epoch within a rank: a prefix read lists a rank's processes in order."""
        return f"{self.log_files}{job}/{rank}/{epoch:010d}-{node}-{pid}"

    def log_requests(self, node: str) -> str:
        return f"{self.prefix}/logs/requests/{node}/"

    def log_request(self, node: str, request: str) -> str:
        return f"{self.log_requests(node)}{request}"

    def log_chunks(self, request: str) -> str:
        return f"{self.prefix}/logs/chunks/{request}/"

    def log_chunk(self, request: str, seq: int) -> str:
        return f"{self.log_chunks(request)}{seq:010d}"

    @staticmethod
    def name_of(key: str, collection: str) -> str:
        """The last path element of ``key`` under ``collection`` (a prefix ending in '/')."""
        return key[len(collection):]
