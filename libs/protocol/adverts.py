"""Executors advertise the ModelFns they can run, so plugins are installed only where they run.

A ModelFn package (an entry point in ``serverless_t2i.modelfns``) is installed in the executor
image that runs it; the registry, which validates specs, may not have it. Each executor process
therefore sends the registry the names and signatures of its installed ModelFns: at start
(retried until a registry answers) and again every ``ttl_s / 3`` seconds. The registry keeps them
in Redis and validates a spec against its own catalog united with every advertisement that has not
expired, so a spec naming a ModelFn nobody advertises is still refused.

| name | kind | carries |
|---|---|---|
| ``{ns}.registry.advertise`` | request/reply, queue group ``registry`` | ``ModelFnAdvert`` -> ``AdvertAck`` |
| ``{ns}:modelfns:advertised`` | Redis hash | executor id -> ``StoredAdvert`` JSON |

Signatures travel as raw JSON: this layer sits below ``libs.workflow`` (whose ``Signature`` the
registry decodes them into, refusing a malformed one by name).
"""

from __future__ import annotations

import msgspec

from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects

#: Bounds on what one advertisement may carry (the registry refuses more).
MAX_FNS = 512
MAX_SIGNATURE_BYTES = 16 << 10


class ModelFnAdvert(msgspec.Struct, tag="advertise", forbid_unknown_fields=True):
    executor: str
    signatures: dict[str, msgspec.Raw]  # ModelFn name -> its Signature as JSON
    ttl_s: float = 300.0  # forget it when not advertised again within this long


class AdvertAck(msgspec.Struct):
    ok: bool
    error: str = ""
    accepted: list[str] = []
    refused: dict[str, str] = {}  # ModelFn name -> why its signature was refused


class StoredAdvert(msgspec.Struct):
    signatures: dict[str, msgspec.Raw]
    expires: float  # unix time


def advertise_subject(ns: str) -> str:
    return Subjects(ns).registry_advertise


def adverts_key(ns: str) -> str:
    return Keys(ns).modelfns_advertised


advert_decoder = msgspec.json.Decoder(ModelFnAdvert)
stored_decoder = msgspec.json.Decoder(StoredAdvert)
