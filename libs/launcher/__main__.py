"""``python -m libs.launcher`` (``make run``): the whole platform on this machine.

With credentials (the default; docs/security.md): a private nats-server with one user per role and
Redis ACL users per role, each process given only its own. ``--insecure``: the NATS at
``T2I_NATS_URL`` as it is, no users. Starts Redis (and, ``--insecure``, NATS) where none answers,
builds the tiny-flux models if missing, starts every service (two executors), registers the
built-in workflow through the HTTP API, generates a sample image to ``out/sample.png`` with the
trained ``flux-shapes`` model (docs/trained-model.md) and prints the evaluator's verdict of it,
prints a curl command that makes another, and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import base64
import signal
import sys
import time
from pathlib import Path

from libs.common.config import load_config
from libs.common.settings import common_settings
from libs.launcher import brokers
from libs.launcher.stack import Stack, StackError
from libs.trained import catalog as shapes_catalog
from services.gateway.config import GatewayConfig

DEV_KEY = "sk-t2i-dev"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m libs.launcher", description=__doc__)
    ap.add_argument("--port", type=int, default=load_config(GatewayConfig, "T2I_GATEWAY_").port)
    ap.add_argument("--executors", type=int, default=2)
    ap.add_argument("--models", default="models", help="folder of model folders")
    ap.add_argument("--out", default="out", help="where the sample image goes")
    ap.add_argument("--var", default="var", help="logs and local broker data")
    ap.add_argument("--no-wait", action="store_true", help="stop after the sample image")
    ap.add_argument(
        "--insecure",
        action="store_true",
        help="no credentials: use the NATS at T2I_NATS_URL and Redis without users (docs/security.md)",
    )
    args = ap.parse_args(argv)

    common = common_settings()  # T2I_NATS_URL, T2I_REDIS_URL, T2I_NAMESPACE (libs/common/settings.py)
    nats_url, redis_url = common.nats_url, common.redis_url
    var = Path(args.var)
    started = brokers.ensure_brokers(nats_url, redis_url, var, nats=args.insecure)

    from libs.models.build import main as build_models  # imports torch: after the brokers check

    print(
        "building the catalog's models (random weights; every family of libs/models/families.py) if missing ..."
    )
    build_models(["--out", args.models, "--all"])

    stack = Stack(
        namespace=common.namespace,
        log_dir=var / "logs",
        model_root=Path(args.models).resolve(),
        gateway_port=args.port,
        executors=args.executors,
        api_keys=f"{DEV_KEY}=local:admin",
        nats_url=nats_url,
        redis_url=redis_url,
        secure=not args.insecure,
    )
    print(
        f"starting gateway, registry, scheduler and {args.executors} executors (logs in {stack.log_dir}) ..."
    )
    try:
        stack.start()
        if stack.secure:
            print(
                f"with credentials: a private nats-server at {stack.bus_url} and Redis ACL users, "
                "one per role (--insecure: none)"
            )
        register_catalog(stack)
        t0 = time.monotonic()
        status, body = stack.http(
            "POST",
            "/v1/images/generations",
            {
                "model": shapes_catalog.NAME,
                "prompt": shapes_catalog.SAMPLE_CAPTION,
                "size": "64x64",
                "seed": 7,
            },
        )
        if status != 200:
            raise StackError(f"sample generation failed: {status} {body}\n{stack.tail('scheduler')}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sample.png").write_bytes(base64.b64decode(body["data"][0]["b64_json"]))
        print(f"wrote {out / 'sample.png'} in {time.monotonic() - t0:.2f}s")
        print(f"evaluator (libs/trained/evaluate.py): {sample_verdict(out / 'sample.png')}")
        print("\nmake another image with:\n")
        print(curl_command(stack.url, args.out))
        print(f"\nor open the web console: {stack.url}/console (API key {DEV_KEY})")
        if args.no_wait:
            return 0
        print("\nserving; Ctrl-C stops everything this command started")
        # Stop on Ctrl-C and on SIGTERM, even when started with SIGINT ignored (a background job).
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        while all(p.poll() is None for p in stack.procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in stack.procs.items() if p.poll() is not None]
        print(f"{dead} exited; stopping", file=sys.stderr)
        for n in dead:
            print(stack.tail(n), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...")
        return 0
    except (StackError, brokers.BrokerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        brokers.stop(started)


def register_catalog(stack: Stack) -> None:
    """Register every catalog workflow and LoRA adapter through the HTTP API, as a user would."""
    import json

    from libs.models import families
    from libs.workflow.spec import encode_spec

    specs = families.workflows()
    for spec in specs:
        status, body = stack.http("POST", "/v1/workflows", json.loads(encode_spec(spec)))
        if status not in (200, 201):
            raise StackError(f"registering {spec.name} failed: {status} {body}")
    for name, path in families.LORAS.items():
        status, body = stack.http("POST", "/v1/loras", {"name": name, "path": path})
        if status not in (200, 201):
            raise StackError(f"registering LoRA {name} failed: {status} {body}")
    print(
        f"registered {len(specs)} workflows and {len(families.LORAS)} LoRA adapters (GET /v1/workflows lists them)"
    )


def sample_verdict(path: Path) -> str:
    """The shapes evaluator's verdict of the sample image against its caption."""
    from PIL import Image

    from libs.trained import evaluate

    with Image.open(path) as image:
        return evaluate.score(image.convert("RGB"), shapes_catalog.SAMPLE_CAPTION).summary()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def curl_command(url: str, out: str) -> str:
    body = (
        '{"model": "flux-shapes", "prompt": "two blue squares at the top on a black background", '
        '"size": "64x64", "seed": 1}'
    )
    return (
        f"curl -s {url}/v1/images/generations \\\n"
        f"  -H 'Authorization: Bearer {DEV_KEY}' -H 'Content-Type: application/json' \\\n"
        f"  -d '{body}' \\\n"
        f"  | python3 -c 'import sys,json,base64; "
        f'open("{out}/squares.png","wb").write(base64.b64decode(json.load(sys.stdin)["data"][0]["b64_json"]))\''
    )


if __name__ == "__main__":
    raise SystemExit(main())
