"""The registry service: validates, versions and serves workflow specs over NATS request/reply.

Subjects ``{ns}.registry.register|get|list``; replicas share a queue group, so the registry
scales like any other service. Specs are validated against the ModelFns installed here united with
those executors advertise on ``{ns}.registry.advertise`` (libs/protocol/adverts.py): a plugin
package is installed only in the executor images that run it. Every request is decoded against
the typed union; a malformed or invalid one gets an error reply naming the field and never
disturbs other requests.
"""

from __future__ import annotations

import logging
import re
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.common.logs import bind_from_headers
from libs.common.metrics import RegistryMetrics
from libs.common.service import run_forever
from libs.protocol.adverts import (
    MAX_FNS,
    MAX_SIGNATURE_BYTES,
    AdvertAck,
    advert_decoder,
    advertise_subject,
)
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
from libs.workflow.modelfn import FN_NAME, IDENT, Signature
from libs.workflow.spec import decode_spec, encode_spec
from libs.workflow.validate import validate_spec
from services.registry.store import AdvertStore, LoraStore, WorkflowStore

log = logging.getLogger(__name__)


class RegistryService:
    def __init__(
        self,
        nc: Client,
        store: WorkflowStore,
        catalog: dict[str, Signature],
        subjects: Subjects,
        loras: LoraStore | None = None,
        adverts: AdvertStore | None = None,
        metrics: RegistryMetrics | None = None,
    ) -> None:
        self.nc = nc
        self.metrics = metrics or RegistryMetrics()  # its own registry: tests run several in a process
        self.store = store
        self.loras = loras or LoraStore(store.redis, store.keys)
        self.adverts = adverts or AdvertStore(store.redis, subjects.ns)
        self.catalog = catalog
        self.subjects = subjects
        self._subs: list = []

    async def start(self) -> None:
        for op in REGISTRY_OPS:
            self._subs.append(
                await self.nc.subscribe(self.subjects.registry(op), queue="registry", cb=self._on_msg)
            )
        self._subs.append(
            await self.nc.subscribe(advertise_subject(self.subjects.ns), queue="registry", cb=self._on_advert)
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
        t0 = time.perf_counter()
        rid = bind_from_headers(msg.headers)  # the request a lookup serves, for the log lines
        op = msg.subject.rpartition(".")[2]
        try:
            reply = await self.handle(msg.data)
        except Exception as e:
            log.exception("registry request failed")
            reply = RegistryReply(ok=False, error=f"internal error: {e}", status=500)
        self.metrics.op(op, reply.status, time.perf_counter() - t0)
        if rid:
            log.info("%s for request %s: %d", op, rid, reply.status)
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
        known = await self.known_fns()
        try:
            normal = validate_spec(spec, known)
        except SpecError as e:
            problems = [Problem(p.path, _explain_unknown(p.message)) for p in e.problems]
            return RegistryReply(
                ok=False,
                error="invalid spec: " + "; ".join(f"{p.path}: {p.message}" for p in problems),
                status=422,
                problems=problems,
            )
        stored, created = await self.store.put(normal)
        log.info("workflow %s v%d %s", stored.name, stored.version, "registered" if created else "unchanged")
        return RegistryReply(
            ok=True, spec=msgspec.Raw(encode_spec(stored)), created=created, status=201 if created else 200
        )

    # -- ModelFns advertised by executors --------------------------------------------------------
    async def known_fns(self) -> dict[str, Signature]:
        """Installed here, united with every live advertisement. The registry's own signature wins
        a conflict, then the most recently refreshed advertisement (a conflict is logged)."""
        known: dict[str, Signature] = {}
        live = sorted((await self.adverts.live()).items(), key=lambda kv: kv[1].expires)
        for executor, stored in live:
            for name, raw in stored.signatures.items():
                try:
                    sig = msgspec.json.decode(raw, type=Signature)
                except msgspec.DecodeError:
                    continue  # checked when it was stored; a foreign write is ignored
                if name in known and known[name] != sig and name not in self.catalog:
                    log.warning("executors advertise different signatures for %s; using %s's", name, executor)
                known[name] = sig
        for name, sig in known.items():
            if name in self.catalog and self.catalog[name] != sig:
                log.warning("an executor advertises %s with another signature than the registry's", name)
        return known | self.catalog

    async def _on_advert(self, msg: Msg) -> None:
        try:
            ack = await self.advertise(msg.data)
        except Exception as e:
            log.exception("advertisement failed")
            ack = AdvertAck(ok=False, error=f"internal error: {e}")
        if msg.reply:
            await msg.respond(msgspec.json.encode(ack))

    async def advertise(self, data: bytes) -> AdvertAck:
        """Check and store one executor's advertisement; signatures that do not check are refused
        (named in the ack) and the rest kept."""
        try:
            advert = advert_decoder.decode(data)
        except msgspec.DecodeError as e:
            return AdvertAck(ok=False, error=f"bad advertisement: {e}")
        if not EXECUTOR_ID.match(advert.executor):
            return AdvertAck(
                ok=False, error=f"executor id {advert.executor!r} must match {EXECUTOR_ID.pattern}"
            )
        if not 10.0 <= advert.ttl_s <= 86400.0:
            return AdvertAck(ok=False, error=f"ttl_s must be within [10, 86400], got {advert.ttl_s}")
        if len(advert.signatures) > MAX_FNS:
            return AdvertAck(ok=False, error=f"at most {MAX_FNS} ModelFns per advertisement")
        accepted: dict[str, msgspec.Raw] = {}
        refused: dict[str, str] = {}
        for name, raw in advert.signatures.items():
            why = check_signature(name, bytes(raw))
            if why:
                refused[name] = why
            else:
                accepted[name] = raw
        await self.adverts.put(advert.executor, accepted, advert.ttl_s)
        if refused:
            log.warning("executor %s: refused signatures %s", advert.executor, refused)
        new = sorted(set(accepted) - set(self.catalog))
        log.info(
            "executor %s advertises %d ModelFns%s",
            advert.executor,
            len(accepted),
            f" (not installed here: {', '.join(new)})" if new else "",
        )
        return AdvertAck(ok=True, accepted=sorted(accepted), refused=refused)


EXECUTOR_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_signature(name: str, raw: bytes) -> str:
    """Why an advertised signature is unusable ("" when it is fine)."""
    if len(name) > 128 or not FN_NAME.match(name):
        return f"{name[:128]!r} is not a ModelFn name"
    if len(raw) > MAX_SIGNATURE_BYTES:
        return f"signature larger than {MAX_SIGNATURE_BYTES} bytes"
    try:
        sig = msgspec.json.decode(raw, type=Signature)
    except msgspec.DecodeError as e:
        return f"bad signature: {e}"
    bad = [n for n in (*sig.inputs, *sig.outputs) if not IDENT.match(n)]
    if bad:
        return f"input/output names must be identifiers: {bad}"
    if not set(sig.optional) <= set(sig.inputs):
        return f"optional inputs {sorted(set(sig.optional) - set(sig.inputs))} are not inputs"
    if len(set(sig.outputs)) != len(sig.outputs):
        return "an output is listed twice"
    return ""


def _explain_unknown(message: str) -> str:
    if message.startswith("unknown ModelFn"):
        return (
            message + "; neither installed in the registry nor advertised by a running executor "
            "(install its package in the executor image: docs/deploy.md)"
        )
    return message


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
