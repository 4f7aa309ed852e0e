"""Step caching through the whole platform: a cached request's state travels from step to step as
a node output, so its steps may run on either executor of the catalog stack (two of them) and the
image is the one a single process computes, which the unit tests show equal to diffusers'
pipeline with the same First-Block-Cache hook.

Two cached requests run at once, so each executor is busy with one request's step while the other
request's next step becomes ready: their steps spread over both executors.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from libs.models import families
from libs.workflow.local import LocalRunner
from tests.support.catalog import KEY, pixels, state

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

STEPS = 8


def body(seed: int, **cache: object) -> dict:
    return {
        "model": "tiny-flux",
        "prompt": "a lighthouse",
        "seed": seed,
        "size": "64x64",
        "num_inference_steps": STEPS,
        "params": {"max_sequence_length": 32, **cache},
    }


def local_image(root, seed: int, **cache: object):
    import torch

    torch.set_num_threads(1)
    spec = next(w for w in families.workflows() if w.name == "tiny-flux")
    fns = families.FAMILIES["flux"].module("workflows").MODELFNS
    params = {
        **{n: p.default for n, p in spec.params.items() if p.default is not None},
        "prompt": "a lighthouse",
        "seed": seed,
        "width": 64,
        "height": 64,
        "num_inference_steps": STEPS,
        "max_sequence_length": 32,
        **cache,
    }
    return LocalRunner(root, classes={c.fn_name: c for c in fns}).run(spec, params)["image"].numpy()


def test_cached_requests_whose_steps_run_on_two_executors_equal_the_single_process_images(
    stack, catalog_models
):
    cache = {"cache": "first_block", "cache_threshold": 1.0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(stack.http, "POST", "/v1/images/generations", body(seed, **cache), key=KEY)
            for seed in (3, 4)
        ]
        results = [f.result() for f in futures]
    for (status, resp), seed in zip(results, (3, 4), strict=True):
        assert status == 200, (resp, stack.tail("scheduler"))
        want = local_image(catalog_models, seed, **cache)
        assert np.array_equal(pixels(resp["data"][0]["b64_json"]), want), seed
        assert not np.array_equal(want, local_image(catalog_models, seed)), "the cache skipped steps"
    used = [set(state(stack, resp["id"])["executors"].split(",")) for _, resp in results]
    assert len(set().union(*used)) == 2 and any(len(u) == 2 for u in used), used


def test_caching_off_is_the_default_and_a_bad_cache_is_refused_naming_the_field(stack, catalog_models):
    status, resp = stack.http("POST", "/v1/images/generations", body(5), key=KEY)
    assert status == 200, resp
    assert np.array_equal(pixels(resp["data"][0]["b64_json"]), local_image(catalog_models, 5))
    for params, field in (({"cache": "teacache"}, "cache"), ({"cache_threshold": 2.0}, "cache_threshold")):
        status, resp = stack.http("POST", "/v1/images/generations", body(5, **params), key=KEY)
        assert status == 422 and field in str(resp), resp
