"""Creating the JetStream resources the services share, idempotently, and reading images safely.

Whichever service starts first creates them; the others find them. Configs are identical in every
service, so a concurrent create is harmless (JetStream answers an identical create with the existing
stream). With credentials (docs/security.md) an operator user creates both up front
(:func:`ensure_all`) and the services' users may not create streams: every ``ensure_*`` therefore
looks first and creates only what is missing.
"""

from __future__ import annotations

import base64
from hashlib import sha256

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadObjectMetaError, BucketNotFoundError, DigestMismatchError, NotFoundError
from nats.js.object_store import ObjectStore

from libs.protocol.subjects import Subjects

INTAKE_MAX_AGE_S = 3600.0
IMAGES_TTL_S = 3600.0


async def ensure_intake_stream(js: JetStreamContext, subjects: Subjects) -> None:
    """The durable work queue of image requests (gateway -> scheduler)."""
    try:
        await js.stream_info(subjects.intake_stream)
        return
    except NotFoundError:
        pass
    await js.add_stream(
        StreamConfig(
            name=subjects.intake_stream,
            subjects=[subjects.intake],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_age=INTAKE_MAX_AGE_S,
            duplicate_window=120.0,
        )
    )


class ImageBucket(ObjectStore):
    """The images bucket, read without a consumer.

    ``ObjectStore.get`` reads an object's chunks through an ordered push consumer. Creating a
    consumer lets its creator name the subject it delivers to, and JetStream then publishes the
    stream's messages there on its own authority, past the creator's publish permissions; a user
    that may write chunks into this bucket could so publish anything anywhere (a forged result, an
    intake message). Here chunks are fetched one by one with ``$JS.API.STREAM.MSG.GET``, so no role
    needs ``CONSUMER.CREATE`` on the bucket's stream.
    """

    async def get(
        self, name: str, writeinto=None, show_deleted: bool | None = False
    ) -> ObjectStore.ObjectResult:
        info = await self.get_info(name, show_deleted)
        if not info.nuid:
            raise BadObjectMetaError
        if info.is_link():  # never written by this platform: the library's way
            return await super().get(name, writeinto, show_deleted)
        result = self.ObjectResult(info=info)
        if not info.size:
            return result
        subject = f"$O.{self._name}.C.{info.nuid}"
        h, parts, seq, got = sha256(), [], 0, 0
        while got < info.size:
            msg = await self._js.get_msg(self._stream, seq=seq + 1, subject=subject, next=True)
            data = msg.data or b""
            if not data:  # chunks are never empty: the object is damaged
                break
            h.update(data)
            got += len(data)
            seq = int(msg.seq or 0)
            if writeinto is not None:
                writeinto.write(data)
            else:
                parts.append(data)
        digest = (info.digest or "").split("=", 1)[-1]
        if got != info.size or h.digest() != base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)):
            raise DigestMismatchError
        result.data = b"".join(parts)
        return result


async def ensure_images_bucket(js: JetStreamContext, subjects: Subjects) -> ObjectStore:
    """The object store that carries PNGs from executors to the gateway (images exceed 1 MiB)."""
    name = subjects.images_bucket
    try:
        await js.object_store(name)
    except BucketNotFoundError:
        try:
            await js.create_object_store(
                name,
                config=ObjectStoreConfig(
                    description="generated images", ttl=IMAGES_TTL_S, storage=StorageType.FILE
                ),
            )
        except Exception:  # noqa: BLE001 - another service created it between our two calls
            await js.object_store(name)
    return ImageBucket(name=name, stream=f"OBJ_{name}", js=js)


async def ensure_all(js: JetStreamContext, subjects: Subjects) -> None:
    """Both, as the operator user before the services start (their users may not create streams)."""
    await ensure_intake_stream(js, subjects)
    await ensure_images_bucket(js, subjects)
