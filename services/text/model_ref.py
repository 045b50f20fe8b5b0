"""What a ``--model`` argument names, and its tokenizer, without loading any weights.

One place decides how ``--model`` is read (bundled default, ``dummy:<preset>``, HF directory,
``.gguf`` file) and what name the model goes by. It imports no torch, so the router uses it too:
the workers (through ``loader.resolve_model``) and the router then agree on names and errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.text.default_model import default_model_path
from services.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelRef:
    """A checked model argument: ``kind`` is "hf", "gguf" or "dummy" (then ``preset`` is set)."""

    kind: str
    name: str
    path: Path | None = None
    preset: str | None = None


def model_display_name(model: str | None) -> str:
    """The name a model argument goes by (no filesystem access)."""
    if not model:
        return default_model_path().stem
    if model.startswith("dummy:"):
        return f"dummy-{model.removeprefix('dummy:')}"
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def parse_model(model: str | None) -> ModelRef:
    """Raise FileNotFoundError / ValueError naming the problem when the argument is unusable."""
    if not model:
        path = default_model_path()
        return ModelRef("gguf", path.stem, path=path)
    name = model_display_name(model)
    if model.startswith("dummy:"):
        return ModelRef("dummy", name, preset=model.removeprefix("dummy:"))
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelRef("hf", name, path=path)
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        return ModelRef("gguf", name, path=path)
    if not path.exists():
        raise FileNotFoundError(
            f"{model}: not a directory, a .gguf file or dummy:<preset> (models are never downloaded)"
        )
    raise ValueError(f"{model}: expected a Hugging Face model directory, a .gguf file or dummy:<preset>")


def load_tokenizer(ref: ModelRef) -> Tokenizer | None:
    """The model's tokenizer, or None when it has none (an HF directory without tokenizer.json)."""
    if ref.kind == "hf":
        return Tokenizer.from_hf_dir(ref.path) if (ref.path / "tokenizer.json").is_file() else None
    if ref.kind == "gguf":
        return Tokenizer.from_gguf(ref.path)
    # Dummy models have no vocabulary of their own; the bundled SmolLM2 tokenizer's ids are valid
    # in every preset's vocabulary, which is enough to drive text through them.
    try:
        return Tokenizer.from_gguf(default_model_path())
    except (FileNotFoundError, ValueError):
        return None
