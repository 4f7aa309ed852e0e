"""A small text-to-image model trained here on procedural shapes, and what judges its images.

* :mod:`libs.trained.shapes`: the captioned data set (64x64 scenes drawn from a seed) and its
  train / held-out split of attribute combinations;
* :mod:`libs.trained.evaluate`: a deterministic, analytic scorer of an image against its caption;
* :mod:`libs.trained.model`: the tiny Flux pipeline (configs, word-level T5 tokenizer);
* :mod:`libs.trained.train`: ``python -m libs.trained.train --out DIR --seed 0`` trains it;
* :mod:`libs.trained.catalog`: the ``flux-shapes`` workflow and installing the committed
  checkpoint (``checkpoints/tiny-flux-shapes``) into a model root.

See docs/trained-model.md. No torch at import time.
"""
