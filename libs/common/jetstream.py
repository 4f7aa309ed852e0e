"""Creating the JetStream resources the services share, idempotently.

Whichever service starts first creates them; the others find them. Configs are identical in every
service, so a concurrent create is harmless (JetStream answers an identical create with the existing
stream).
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError
from nats.js.object_store import ObjectStore

from libs.protocol.subjects import Subjects

INTAKE_MAX_AGE_S = 3600.0
IMAGES_TTL_S = 3600.0


async def ensure_intake_stream(js: JetStreamContext, subjects: Subjects) -> None:
    """The durable work queue of image requests (gateway -> scheduler)."""
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


async def ensure_images_bucket(js: JetStreamContext, subjects: Subjects) -> ObjectStore:
    """The object store that carries PNGs from executors to the gateway (images exceed 1 MiB)."""
    try:
        return await js.object_store(subjects.images_bucket)
    except BucketNotFoundError:
        pass
    try:
        return await js.create_object_store(
            subjects.images_bucket,
            config=ObjectStoreConfig(
                description="generated images", ttl=IMAGES_TTL_S, storage=StorageType.FILE
            ),
        )
    except Exception:  # noqa: BLE001 - another service created it between our two calls
        return await js.object_store(subjects.images_bucket)
