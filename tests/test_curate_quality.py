"""Curation stages 5-7: Gopher/C4 quality rules, perplexity buckets, PII masking."""
import json
import os
import random

import pytest

from configs import curate as curate_config
from data.curate import pii
from data.curate import pipeline
from data.curate import quality

# Natural English sentences written for these tests.
SENTENCES = """The old bridge over the river was built more than two hundred years ago.
Every morning the baker opens his shop before the sun comes up.
Children in the village walk to school along a narrow path through the fields.
In winter the lake freezes and people skate on it after work.
My grandmother keeps a small garden with tomatoes, beans and a few rows of lettuce.
The train to the city leaves at half past seven and is usually full.
A good cup of tea is the best way to start a cold and rainy day.
The museum has a large collection of paintings from the nineteenth century.
When the storm arrived, the fishermen pulled their boats onto the beach.
She has been learning to play the piano since she was six years old.
The library is quiet in the afternoon, so it is a good place to study.
We walked along the coast and watched the waves break on the rocks.
Most of the houses in the town are made of red brick and have steep roofs.
The teacher asked the students to write a short story about their holidays.
After dinner the family sat by the fire and listened to the radio.
The market on Saturday sells fresh fruit, cheese, bread and flowers.
He repaired the roof of the barn before the first snow fell.
The doctor said that a long walk every day is good for the heart.
There is a small café at the corner where the coffee is very strong.
The farmers hope for rain because the summer has been dry and hot.
In the evening the streets are full of people going home from work.
The cat sleeps on the windowsill whenever the sun shines into the kitchen.
They planted a row of apple trees at the edge of the orchard.
The children laughed when the dog jumped into the pond after the ball.
Our neighbours invited us to a party to celebrate the end of the harvest.
The road to the mountain village is steep and has many sharp bends.
It took the builders three months to finish the new school.
On Sundays the church bells ring across the whole valley.
The river was so high after the rain that the lower fields were flooded.
He wrote a long letter to his brother who lives on the other side of the country.""".split("\n")

GOOD = " ".join(SENTENCES[:8])


def _cfg():
  return curate_config.get_config().quality


def test_good_english_document_passes():
  assert quality.check(GOOD, "en", _cfg()) is None


@pytest.mark.parametrize("text,rule", [
    (" ".join(SENTENCES[:2]), "min_words"),
    ("a b c d e f g h i j " * 8, "mean_word_length"),
    (GOOD + " " + " ".join("#" + w for w in SENTENCES[9].split() + SENTENCES[10].split()), "symbol_word_ratio"),
    ("\n".join("• " + s for s in SENTENCES[:8]), "bullet_lines"),
    ("\n".join(s[:-1] + "..." for s in SENTENCES[:8]), "ellipsis_lines"),
    (GOOD + " " + " ".join(["12345", "678", "91011", "-", "2024"] * 8), "alpha_words"),
    (" ".join(w for w in GOOD.split() if w.lower() not in quality.STOP_WORDS["en"] | {"the."}), "stop_words"),
    ("\n".join(SENTENCES[:5] + [SENTENCES[0]] * 4), "duplicate_lines"),
    (GOOD + " cheap shoes" * 15, "top_2gram"),
    (GOOD + " " + " ".join(SENTENCES[2].split()[:12]) + " " + " ".join(SENTENCES[2].split()[:12]), "duplicate_5gram"),
    (GOOD + " Lorem ipsum dolor sit amet.", "lorem_ipsum"),
    ("\n".join(SENTENCES[:6] + ["Read our privacy policy.", "See the terms of use.",
                                "Please enable javascript to continue."]), "policy_lines"),
])
def test_each_rule_fires(text, rule):
  assert quality.check(text, "en", _cfg()) == rule


def test_rules_that_depend_on_language_and_script():
  no_stop_words = " ".join(w for w in GOOD.split() if w.lower() not in quality.STOP_WORDS["en"] | {"the."})
  assert quality.check(no_stop_words, "de", _cfg()) is None  # the stop-word list is English
  chinese = ("图书馆每天早上九点开门，大多数学生会在第一节课之前到达。下雨的时候阅览室总是坐满了人，所以最好早点来，"
             "在窗边找一个安静的座位。图书馆的工作人员都很热情，愿意帮助大家寻找旧报纸和珍贵的地图。")
  assert quality.check(chinese, "zh", _cfg()) is None  # no spaces: words of characters
  assert quality.check(chinese[:30], "zh", _cfg()) == "min_words"


def test_repetition_rules_judge_japanese_as_its_translation_and_still_catch_spam():
  """Technical Japanese repeats a five-character katakana word ("package") as English repeats one word: the
  n-gram rules must span words, not single characters, while a repeated sales line still fails."""
  japanese = ("Debianでは、パッケージの管理にaptを使います。新しいパッケージをインストールするときは、まずパッケージの一覧を"
              "更新してください。パッケージの依存関係は自動的に解決されるので、必要なパッケージもいっしょにインストールされ"
              "ます。不要になったパッケージは、設定ファイルも含めて削除できます。古いパッケージを残しておくと、ディスクの容量"
              "が足りなくなることがあります。")
  english = ("On Debian, packages are managed with apt. Before you install a new package, first update the list of "
             "packages. The dependencies of a package are resolved automatically, so the packages it needs are "
             "installed with it. A package you no longer need can be removed together with its configuration files. "
             "If you keep old packages around, the disk may run out of space.")
  spam = "欢迎访问我们的网站，这里有最好的产品和最低的价格。" * 6
  assert quality.check(english, "en", _cfg()) is None
  assert quality.check(japanese, "ja", _cfg()) is None
  assert quality.check(spam, "zh", _cfg()) is not None
  per_character = _cfg()
  per_character.spaceless_chars_per_word = 1  # the rules as they were: one word per character
  assert quality.check(japanese, "ja", per_character) == "duplicate_5gram"


def test_pii_masking():
  cfg = curate_config.get_config().pii
  text = ("Mail anna.schmidt@example.com or bob@mail.example.org, call +49 30 1234 5678 or (030) 123-4567; "
          "the server is 192.168.10.7 (fe80:0:0:0:202:b3ff:fe1e:8329). On 2024-05-01 we sold 1,250 copies.")
  masked, count = pii.mask(text, cfg)
  assert masked == ("Mail <EMAIL> or <EMAIL>, call <PHONE> or <PHONE>; the server is <IP> (<IP>). "
                    "On 2024-05-01 we sold 1,250 copies.")
  assert count == 6
  cfg.phone = False
  assert "+49 30 1234 5678" in pii.mask(text, cfg)[0]


def _filter_corpus(tmp_path):
  rng = random.Random(0)
  docs = []
  for i in range(10):  # natural documents: sentences of the reference text in a new order
    docs.append((f"natural-{i}", " ".join(rng.sample(SENTENCES, 8))))
  for i in range(5):  # word salad: the same words as natural documents, shuffled (a unigram model can't tell)
    words = " ".join(rng.sample(SENTENCES, 8)).split()
    rng.shuffle(words)
    docs.append((f"salad-{i}", " ".join(words)))
  letters = "abcdefghijklmnopqrstuvwxyz"
  docs.append(("gibberish", " ".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))
                                      for _ in range(90))))
  docs.append(("boilerplate", "\n".join(["Home | About us | Products | Contact", "Login | Register | Cart (0)",
                                        "This website uses cookies. By continuing you accept our cookie policy.",
                                        "Privacy policy | Terms of use | Imprint",
                                        "Copyright 2024 Example Shop. All rights reserved."] * 3)))
  with open(tmp_path / "docs.jsonl", "w") as f:
    for doc_id, text in docs:
      f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
  with open(tmp_path / "reference.txt", "w") as f:
    f.write("\n".join(SENTENCES * 3) + "\n")
  return docs


def test_boilerplate_and_gibberish_are_filtered_or_tail(tmp_path):
  _filter_corpus(tmp_path)
  cfg = curate_config.get_config()
  cfg.input, cfg.output, cfg.num_workers = str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), 1
  cfg.dedup.enabled = cfg.minhash.enabled = False  # documents share sentences on purpose
  cfg.perplexity.reference = (str(tmp_path / "reference.txt"),)
  cfg.perplexity.vocab_size = 400
  stats = pipeline.run(cfg)
  out = {}
  for root, _, files in os.walk(tmp_path / "out"):
    for name in files:
      if name.endswith(".jsonl") and "_work" not in root:
        with open(os.path.join(root, name)) as f:
          out.update({r["id"]: r for r in map(json.loads, f)})
  assert "gibberish" not in out and "boilerplate" not in out
  assert all(out[f"salad-{i}"]["bucket"] == "tail" for i in range(5))
  # Buckets are per-language percentiles (30th, 60th): 40% of the documents are tail, so some natural ones too.
  assert all(r["id"].startswith("natural") for r in out.values() if r["bucket"] in ("head", "middle"))
  worst_natural = max(out[f"natural-{i}"]["perplexity"] for i in range(10))
  assert all(out[f"salad-{i}"]["perplexity"] > 2 * worst_natural for i in range(5))
  assert {r["language"] for r in out.values()} == {"en"}
  assert stats["cutoffs"]["en"][0] < stats["cutoffs"]["en"][1]
  # stats.md is the readable table; stats.json agrees with what was written.
  table = (tmp_path / "out" / "stats.md").read_text()
  assert "| quality |" in table and "| en |" in table
  assert sum(b["docs"] for b in stats["output"]["en"].values()) == len(out)
