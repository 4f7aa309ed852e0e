"""What the random-weight builders share: atomic, idempotent builds marked by a manifest.

The builders (:mod:`libs.models.tiny_flux`, :mod:`~libs.models.tiny_sd`,
:mod:`~libs.models.tiny_sd3`, :mod:`~libs.models.tiny_sana`) write model folders and LoRA files
whose weights are a function of a seed. Each artifact has a *manifest*, a small JSON object (its
family, kind or preset, seed, ...) that is written last, so an interrupted build never looks
complete and a complete one is recognised and left alone:

* :func:`build_folder`: a folder, built into a temporary sibling (``.<name>.building-*``) by
  ``save(tmp)``, its manifest ``t2i-model.json`` (:data:`MANIFEST`) written inside it last, then
  renamed into place. A folder whose manifest already matches is not rebuilt; neither is one that a
  concurrent build finished first.
* :func:`build_file`: a single file (a LoRA's safetensors), written by ``save(tmp)`` into a
  temporary sibling folder, moved into place (mode 0644), then its sidecar manifest written beside
  it (:func:`sidecar_path`; each family names its sidecar). The old manifest is removed first, so a
  half-replaced file is never taken for a built one.
* :func:`read_manifest` / :func:`write_manifest`: a manifest file read (None if missing or
  unreadable) and written atomically (temporary file + rename).

Random weights that are zero by construction would make a test compare nothing (a ControlNet's
"zero convolutions", a fresh LoRA's ``lora_B``): :func:`randomize_` re-draws tensors from a
dedicated generator, and :func:`random_lora_` attaches a peft adapter and re-draws its ``lora_B``.
The order of the tensors is the order of the draws; callers keep theirs so built weights stay the
same.

Tokenizers are built from in-memory vocabularies (transformers 5 needs no downloaded files); the
Flux and SD families use both, SD3 its CLIP twice:

* :func:`clip_tokenizer`: a byte-level BPE with no merges over single characters, each with a
  word-final ``</w>`` twin; lower-case letters, digits and common punctuation (CLIP lower-cases its
  input). Ids 0/1 are ``<|startoftext|>``/``<|endoftext|>``, matching the text configs' bos/eos (CLIP
  pools at the eos id).
* :func:`t5_tokenizer`: a Unigram vocabulary of ``<pad>``, ``</s>``, ``<unk>`` (ids 0/1/2, as the T5
  config expects), then word-initial pieces ``▁c`` and inner pieces ``c`` for letters of both cases,
  digits and punctuation.

No torch at import time (the catalog imports the builder modules without it).
"""

from __future__ import annotations

import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MANIFEST = "t2i-model.json"  # a built folder's manifest, inside it

# Characters the tiny tokenizers know; anything else becomes the unknown token.
_PUNCTUATION = ".,!?'-:;()&/\"#+*%$@"
_CLIP_CHARS = string.ascii_lowercase + string.digits + _PUNCTUATION
_T5_CHARS = string.ascii_letters + string.digits + _PUNCTUATION


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest at ``path`` (a manifest file), or None if there is none or it is unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write ``data`` as the manifest file ``path``, atomically (temporary file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def sidecar_path(file: str | os.PathLike[str], suffix: str) -> Path:
    """The manifest beside ``file``: its name without ``.safetensors``, plus ``suffix``."""
    p = Path(file)
    return p.with_name(p.name.removesuffix(".safetensors") + suffix)


def build_folder(out: str | os.PathLike[str], manifest: dict[str, Any], save: Callable[[Path], None]) -> Path:
    """Build a folder at ``out`` with ``save(tmp)`` unless its manifest already says ``manifest``;
    the build goes to a temporary sibling that is renamed into place, manifest last."""
    out = Path(out)
    if read_manifest(out / MANIFEST) == manifest:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        save(tmp)
        write_manifest(tmp / MANIFEST, manifest)  # last: the folder is complete
        tmp.chmod(0o755)  # mkdtemp made it private
        if out.exists():
            if read_manifest(out / MANIFEST) == manifest:  # a concurrent build finished first
                return out
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_file(
    out: str | os.PathLike[str],
    manifest_path: str | os.PathLike[str],
    manifest: dict[str, Any],
    save: Callable[[Path], None],
) -> Path:
    """Write the file ``out`` with ``save(tmp)`` (which writes ``tmp / out.name``) unless it exists
    and the manifest file ``manifest_path`` says ``manifest``; the manifest is written last."""
    out, manifest_path = Path(out), Path(manifest_path)
    if out.is_file() and read_manifest(manifest_path) == manifest:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        save(tmp)
        (tmp / out.name).chmod(0o644)  # as readable as the model folders
        (tmp / out.name).replace(out)
        write_manifest(manifest_path, manifest)  # last: the file is complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def randomize_(tensors: Iterable[Any], seed: int, std: float) -> None:
    """Overwrite ``tensors`` in place, in order, with N(0, std) draws from a generator seeded with
    ``seed`` (the global RNG is left alone)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * std)


def random_lora_(
    model: Any, seed: int, std: float = 0.5, *, sort_names: bool = False, **config: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Attach a peft ``LoraConfig(**config)`` to ``model`` as adapter ``"default"`` (``lora_A``
    drawn from the global RNG by peft's init), re-draw its zero ``lora_B`` with :func:`randomize_`
    (``seed``, ``std``; in parameter order, or sorted by name) and return (the adapter's
    ``get_peft_model_state_dict``, its config as a dict: the metadata ``save_lora_weights`` takes)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model.add_adapter(LoraConfig(**config))
    named = sorted(model.named_parameters()) if sort_names else list(model.named_parameters())
    randomize_([p for n, p in named if "lora_B" in n], seed=seed, std=std)
    return get_peft_model_state_dict(model), model.peft_config["default"].to_dict()


def clip_tokenizer() -> Any:
    """The in-memory CLIP tokenizer of the tiny families (see the module docstring)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CLIP_CHARS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer() -> Any:
    """The in-memory T5 tokenizer of the tiny families (see the module docstring)."""
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    vocab += [("▁" + c, -1.0) for c in _T5_CHARS]
    vocab += [(c, -2.0) for c in _T5_CHARS]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)


def save_in_hub_cache(
    folder: str | os.PathLike[str], repo_id: str, cache_dir: str | os.PathLike[str]
) -> Path:
    """Lay ``folder`` (a saved pipeline or component) out in ``cache_dir`` as the Hugging Face hub
    client caches a download of ``repo_id`` (``models--org--name/``: every file a content-named blob
    under ``blobs/``, linked from ``snapshots/<commit>/``, ``refs/main`` naming the commit), so it
    resolves offline (``HF_HUB_OFFLINE=1``) as if it had been downloaded. The commit is a hash of
    the files; hidden folders (converted checkpoints) are left out. Returns the snapshot folder."""
    import hashlib

    src = Path(folder)
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    files = sorted(
        p
        for p in src.rglob("*")
        if p.is_file() and not any(x.startswith(".") for x in p.relative_to(src).parts)
    )
    digests = {}
    for p in files:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 24), b""):
                h.update(block)
        digests[p] = h.hexdigest()
    commit = hashlib.sha1(
        "".join(f"{p.relative_to(src)}:{d}\n" for p, d in digests.items()).encode()
    ).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for p, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(p, blob)
        link = snapshot / p.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
