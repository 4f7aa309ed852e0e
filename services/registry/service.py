"""The registry service: validates, versions and serves workflow specs over NATS request/reply.

Subjects ``{ns}.registry.register|get|list``; replicas share a queue group, so the registry
scales like any other service. Every request is decoded against the typed union; a malformed or
invalid one gets an error reply naming the field and never disturbs other requests.
"""

from __future__ import annotations

import logging
import re

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.common.service import run_forever
from libs.protocol.messages import (
    GetLora,
    GetWorkflow,
    ListLoras,
    ListWorkflows,
    LoraInfo,
    Problem,
    RegisterLora,
    RegisterWorkflow,
    RegistryReply,
    encode,
    registry_request_decoder,
)
from libs.protocol.subjects import REGISTRY_OPS, Subjects
from libs.workflow.errors import SpecError
from libs.workflow.modelfn import Signature
from libs.workflow.spec import decode_spec, encode_spec
from libs.workflow.validate import validate_spec
from services.registry.store import LoraStore, WorkflowStore

log = logging.getLogger(__name__)


class RegistryService:
    def __init__(
        self,
        nc: Client,
        store: WorkflowStore,
        catalog: dict[str, Signature],
        subjects: Subjects,
        loras: LoraStore | None = None,
    ) -> None:
        self.nc = nc
        self.store = store
        self.loras = loras or LoraStore(store.redis, store.keys)
        self.catalog = catalog
        self.subjects = subjects
        self._subs: list = []

    async def start(self) -> None:
        for op in REGISTRY_OPS:
            self._subs.append(
                await self.nc.subscribe(self.subjects.registry(op), queue="registry", cb=self._on_msg)
            )
        log.info(
            "registry ready (%s): %d ModelFns: %s",
            self.subjects.ns,
            len(self.catalog),
            ", ".join(sorted(self.catalog)),
        )

    async def run(self) -> None:
        await run_forever()  # all work happens in the subscriptions' callbacks

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may already be closed
                pass
        self._subs.clear()

    async def _on_msg(self, msg: Msg) -> None:
        try:
            reply = await self.handle(msg.data)
        except Exception as e:  # noqa: BLE001 - a bug in one request must not kill the service
            log.exception("registry request failed")
            reply = RegistryReply(ok=False, error=f"internal error: {e}", status=500)
        if msg.reply:
            await msg.respond(encode(reply))

    async def handle(self, data: bytes) -> RegistryReply:
        try:
            req = registry_request_decoder.decode(data)
        except msgspec.DecodeError as e:
            return RegistryReply(ok=False, error=f"bad registry request: {e}", status=400)
        match req:
            case RegisterWorkflow(spec=raw):
                return await self.register(bytes(raw))
            case GetWorkflow(name=name, version=version):
                spec = await self.store.get(name, version)
                if spec is None:
                    what = f"version {version} of workflow" if version else "workflow"
                    return RegistryReply(ok=False, error=f"{what} {name!r} not found", status=404)
                return RegistryReply(ok=True, spec=msgspec.Raw(encode_spec(spec)))
            case ListWorkflows():
                return RegistryReply(ok=True, workflows=await self.store.list())
            case RegisterLora(lora=lora):
                problems = check_lora(lora)
                if problems:
                    error = "invalid LoRA: " + "; ".join(f"{p.path}: {p.message}" for p in problems)
                    return RegistryReply(ok=False, error=error, status=422, problems=problems)
                created = await self.loras.put(lora)
                log.info("LoRA %s -> %s %s", lora.name, lora.path, "registered" if created else "updated")
                return RegistryReply(ok=True, loras=[lora], created=created, status=201 if created else 200)
            case GetLora(name=name):
                found = await self.loras.get(name)
                if found is None:
                    return RegistryReply(ok=False, error=f"unknown LoRA {name!r}", status=404)
                return RegistryReply(ok=True, loras=[found])
            case ListLoras():
                return RegistryReply(ok=True, loras=await self.loras.list())
        return RegistryReply(ok=False, error="unhandled request", status=400)  # pragma: no cover

    async def register(self, raw: bytes) -> RegistryReply:
        try:
            spec = decode_spec(raw)
        except msgspec.ValidationError as e:
            path = _path_of(str(e))
            return RegistryReply(
                ok=False, error=f"invalid spec: {e}", status=422, problems=[Problem(path, str(e))]
            )
        except msgspec.DecodeError as e:
            return RegistryReply(ok=False, error=f"spec is not JSON: {e}", status=400)
        try:
            normal = validate_spec(spec, self.catalog)
        except SpecError as e:
            return RegistryReply(
                ok=False,
                error=f"invalid spec: {e}",
                status=422,
                problems=[Problem(p.path, p.message) for p in e.problems],
            )
        stored, created = await self.store.put(normal)
        log.info("workflow %s v%d %s", stored.name, stored.version, "registered" if created else "unchanged")
        return RegistryReply(
            ok=True, spec=msgspec.Raw(encode_spec(stored)), created=created, status=201 if created else 200
        )


LORA_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


def check_lora(lora: LoraInfo) -> list[Problem]:
    """A LoRA's name is a lowercase slug; its path is a .safetensors file relative to the executors'
    model root, without `..` (executors also refuse one that resolves outside the root)."""
    problems = []
    if not LORA_NAME.match(lora.name):
        problems.append(Problem("name", f"{lora.name!r} must match {LORA_NAME.pattern}"))
    if not lora.path or len(lora.path) > 1024 or not lora.path.endswith(".safetensors"):
        problems.append(Problem("path", "must be the path of a .safetensors file (at most 1024 characters)"))
    elif ".." in lora.path.replace("\\", "/").split("/"):
        problems.append(Problem("path", "must not contain `..`"))
    elif lora.path.startswith(("/", "\\", "~")) or (len(lora.path) > 1 and lora.path[1] == ":"):
        problems.append(Problem("path", "must be relative to the executors' model root"))
    elif "\x00" in lora.path:
        problems.append(Problem("path", "must not contain NUL"))
    if len(lora.description) > 1000:
        problems.append(Problem("description", "at most 1000 characters"))
    return problems


def _path_of(message: str) -> str:
    # msgspec says "... - at `$.body[0].fn`"; turn that into "body[0].fn".
    if "at `$" in message:
        return message.rsplit("at `$", 1)[1].rstrip("`").lstrip(".") or "spec"
    return "spec"
