"""Every NATS subject, stream and bucket name the platform uses, in one place.

All names hang off a namespace (``T2I_NAMESPACE``), so test runs and deployments sharing a NATS
server never see each other's traffic.

| name | kind | carries |
|---|---|---|
| ``{ns}.intake`` | JetStream work queue ``{NS}_INTAKE`` | ``ImageRequest`` gateway -> scheduler |
| ``{ns}.registry.{register,get,list}`` | request/reply, queue group ``registry`` | ``RegisterWorkflow``, ``GetWorkflow``, ``ListWorkflows`` -> ``RegistryReply`` |
| ``{ns}.registry.lora`` | request/reply, queue group ``registry`` | ``RegisterLora``, ``GetLora``, ``ListLoras`` -> ``RegistryReply`` |
| ``{ns}.exec.{executor_id}`` | request/reply | ``Dispatch`` -> ``Ack``; pub/sub: ``ReleaseRequest``, ``CallbackReady``, ``CancelNode`` (all from the scheduler only) |
| ``{ns}.exec.{executor_id}.release`` | pub/sub | ``ReleaseTensors`` consumer -> producer (the only executor -> executor message) |
| ``{ns}.exec.all`` | pub/sub | ``ReleaseRequest`` broadcast (request failed or restarted) |
| ``{ns}.sched.events.{executor_id}`` | pub/sub | ``NodeComplete``, ``NodeFailed``, ``ExecutorHeartbeat``, ``ExecutorGoodbye`` of that executor; the scheduler subscribes to ``{ns}.sched.events.*`` and drops an event whose ``executor`` is not the subject's last token |
| ``{ns}.results.{request_id}`` | pub/sub | ``RequestResult`` scheduler -> gateway |
| ``{ns}.sched.cancel`` | pub/sub | ``CancelRequest`` gateway -> scheduler (a nudge: the Redis flag is what survives) |
| ``{ns}-images`` | JetStream object store | PNGs (images exceed NATS' 1 MiB payload limit) |
"""

from __future__ import annotations

from dataclasses import dataclass

#: The registry's request/reply operations, each its own subject.
REGISTRY_OPS = ("register", "get", "list", "lora")


@dataclass(frozen=True)
class Subjects:
    ns: str

    @property
    def intake(self) -> str:
        return f"{self.ns}.intake"

    @property
    def intake_stream(self) -> str:
        # Stream names may not contain '.', '*', '>' or spaces.
        return f"{self.ns.upper().replace('-', '_')}_INTAKE"

    @property
    def intake_durable(self) -> str:
        return "scheduler"

    def registry(self, op: str) -> str:
        if op not in REGISTRY_OPS:
            raise ValueError(f"unknown registry operation {op!r}; one of {REGISTRY_OPS}")
        return f"{self.ns}.registry.{op}"

    @property
    def registry_all(self) -> str:
        """Every registry subject (a permission pattern)."""
        return f"{self.ns}.registry.*"

    @property
    def registry_advertise(self) -> str:
        """Where executors advertise their ModelFns (``libs/protocol/adverts.py``)."""
        return f"{self.ns}.registry.advertise"

    def executor(self, executor_id: str) -> str:
        return f"{self.ns}.exec.{executor_id}"

    def executor_release(self, executor_id: str) -> str:
        """Where consumers send a producer their ``ReleaseTensors`` (``*``: every executor's)."""
        return f"{self.ns}.exec.{executor_id}.release"

    @property
    def executors_all(self) -> str:
        return f"{self.ns}.exec.all"

    def executor_events(self, executor_id: str) -> str:
        """Where one executor publishes its events (``*``: every executor's, what the scheduler
        subscribes to). Its last token names the executor: the scheduler checks events against it."""
        return f"{self.ns}.sched.events.{executor_id}"

    @property
    def sched_events(self) -> str:
        """Every executor's events: the scheduler's subscription."""
        return self.executor_events("*")

    def events_sender(self, subject: str) -> str:
        """The executor an events subject belongs to ("" when ``subject`` is not one)."""
        prefix = f"{self.ns}.sched.events."
        return subject[len(prefix) :] if subject.startswith(prefix) else ""

    @property
    def cancels(self) -> str:
        """Where the gateway asks the leading scheduler to cancel an image request."""
        return f"{self.ns}.sched.cancel"

    def result(self, request_id: str) -> str:
        return f"{self.ns}.results.{request_id}"

    @property
    def images_bucket(self) -> str:
        return f"{self.ns}-images"
