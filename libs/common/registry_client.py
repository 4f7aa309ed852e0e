"""Talking to the registry over NATS request/reply (used by the gateway and the scheduler)."""

from __future__ import annotations

import logging
from collections import OrderedDict

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from libs.common.logs import REQUEST_ID_HEADER, current_request_id
from libs.errors import RetryableError, T2IError
from libs.protocol.messages import (
    GetLora,
    GetWorkflow,
    ListLoras,
    ListWorkflows,
    LoraInfo,
    RegisterLora,
    RegisterWorkflow,
    RegistryReply,
    encode,
    registry_reply_decoder,
)
from libs.protocol.subjects import Subjects
from libs.workflow.spec import WorkflowSpec, decode_spec

log = logging.getLogger(__name__)


class RegistryUnavailable(RetryableError, RuntimeError):
    """No registry answered; retrying later can help."""


class WorkflowNotFound(T2IError, LookupError):
    def __init__(self, name: str, version: int = 0) -> None:
        self.name = name
        self.version = version
        super().__init__(f"workflow {name!r}" + (f" version {version}" if version else "") + " not found")


class RegistryClient:
    def __init__(self, nc: Client, subjects: Subjects, timeout: float = 5.0, cache_size: int = 256) -> None:
        self.nc = nc
        self.subjects = subjects
        self.timeout = timeout
        self._cache: OrderedDict[tuple[str, int], WorkflowSpec] = OrderedDict()
        self._cache_size = cache_size
        self._latest: dict[str, int] = {}  # name -> the newest version seen (see ``get``)

    async def _call(self, op: str, payload: bytes, request_id: str = "") -> RegistryReply:
        # The request this lookup serves (given, or bound in the caller's log context) travels in a
        # header, so the registry's log lines about it carry its id too (docs/observability.md).
        rid = request_id or current_request_id()
        headers = {REQUEST_ID_HEADER: rid} if rid else None
        try:
            msg = await self.nc.request(
                self.subjects.registry(op), payload, timeout=self.timeout, headers=headers
            )
        except (NoRespondersError, NatsTimeoutError, TimeoutError) as e:
            raise RegistryUnavailable(f"registry did not answer {op!r}: {type(e).__name__}") from e
        return registry_reply_decoder.decode(msg.data)

    async def get(self, name: str, version: int = 0, request_id: str = "") -> WorkflowSpec:
        """A spec by name (latest) or by name and version. Versions are immutable: cached.

        While no registry answers, a lookup of the latest version is answered with the latest this
        client has seen (logged): a registry restart then holds up no request for a workflow in
        use; one registered or updated during the outage is not seen until it is back."""
        if version and (name, version) in self._cache:
            self._cache.move_to_end((name, version))
            return self._cache[(name, version)]
        try:
            reply = await self._call("get", encode(GetWorkflow(name=name, version=version)), request_id)
            if not reply.ok and reply.status != 404:
                raise RegistryUnavailable(reply.error)
        except RegistryUnavailable as e:
            seen = self._latest.get(name) if not version else None
            if seen is None or (name, seen) not in self._cache:
                raise
            log.warning("registry unavailable (%s): using the last seen version %d of %r", e, seen, name)
            return self._cache[(name, seen)]
        if not reply.ok:
            raise WorkflowNotFound(name, version)
        spec = decode_spec(bytes(reply.spec))
        self._cache[(spec.name, spec.version)] = spec
        if spec.version >= self._latest.get(spec.name, 0):
            self._latest[spec.name] = spec.version
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return spec

    async def register(self, spec_json: bytes, tenant: str = "") -> RegistryReply:
        import msgspec

        return await self._call(
            "register", encode(RegisterWorkflow(spec=msgspec.Raw(spec_json), tenant=tenant))
        )

    async def list(self) -> RegistryReply:
        return await self._call("list", encode(ListWorkflows()))

    async def register_lora(self, lora: LoraInfo) -> RegistryReply:
        return await self._call("lora", encode(RegisterLora(lora=lora)))

    async def lora(self, name: str) -> LoraInfo | None:
        reply = await self._call("lora", encode(GetLora(name=name)))
        if not reply.ok:
            if reply.status == 404:
                return None
            raise RegistryUnavailable(reply.error)
        return reply.loras[0]

    async def list_loras(self) -> list[LoraInfo]:
        return (await self._call("lora", encode(ListLoras()))).loras
