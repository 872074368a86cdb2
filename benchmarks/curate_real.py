"""Curation on real multilingual text written by others: the Debian Reference manual in eight languages.

    apt-get install debian-reference-{en,de,fr,es,it,pt,ja,zh-cn}
    JAX_PLATFORMS=cpu python benchmarks/curate_real.py [--docs-per-language 40] [--workers 1] [--dir /tmp/x]

The manual is translated with po4a, so the `<p>` paragraphs of /usr/share/debian-reference/chNN.LANG.html line up
across languages. A document is three consecutive paragraphs of one chapter; the same positions are taken in every
language (those whose English text holds at least 80 words and that every translation translates, evenly spaced;
`--untranslated` also takes positions where some translation left English paragraphs). Added: 20 exact copies and 20 near
copies (one word changed) of real documents, after their originals, and 10 navigation-junk documents. The
perplexity model of each language is trained on that language's other paragraphs. Prints one JSON object:
documents kept per language, duplicates removed per kind, junk in the head bucket, language-id accuracy on kept
documents, documents per second, and the per-stage counts. Without the packages it prints a notice and exits 0.
"""
from __future__ import annotations

import argparse
import glob
import html
import json
import os
import random
import re
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import curate as curate_config  # noqa: E402
from data.curate import pipeline  # noqa: E402

ROOT = "/usr/share/debian-reference"
LANGUAGES = {"en": "en", "de": "de", "fr": "fr", "es": "es", "it": "it", "pt": "pt", "ja": "ja", "zh-cn": "zh"}
JUNK = [
    "Home | Download | Support | Contact | Search\nPrevious | Up | Next | Table of contents\nPrivacy policy | "
    "Terms of use | Cookies",
    "Skip to main content\nMenu\nLog in | Register | Cart (0)\nFollow us: Facebook Twitter YouTube\nAll rights "
    "reserved.",
    "Startseite | Über uns | Produkte | Kontakt | Impressum\nDatenschutz | AGB | Cookie-Einstellungen",
    "Accueil | Actualités | Téléchargements | Contact\nMentions légales | Politique de confidentialité | Plan du site",
    "Inicio | Noticias | Descargas | Contacto\nAviso legal | Política de privacidad | Mapa del sitio",
    "ホーム | ニュース | ダウンロード | お問い合わせ\nプライバシーポリシー | 利用規約 | サイトマップ",
    "首页 | 新闻 | 下载 | 联系我们\n隐私政策 | 使用条款 | 网站地图 | 登录 | 注册",
    "Home\nAbout\nBlog\nContact\nLogin\nSign up\nFAQ\nHelp\nSitemap\nJobs\nPress\nLegal",
    "« Previous page | Next page »\nPage 1 2 3 4 5 6 7 8 9 10 ... 42\nBack to top",
    "Home > Docs > Manual > Chapter 3 > Section 3.1 > 3.1.2\nEdit this page | Report an issue | Print | Share",
]


def paragraphs(lang: str) -> list[list[str]]:
  """Per chapter file (sorted), its `<p>` paragraphs as plain text (tags dropped, entities decoded)."""
  chapters = []
  for path in sorted(glob.glob(os.path.join(ROOT, f"ch*.{lang}.html"))):
    with open(path, encoding="utf-8") as f:
      page = f.read()
    found = (" ".join(html.unescape(re.sub(r"<[^>]+>", "", p)).split())
             for p in re.findall(r"<p\b[^>]*>(.*?)</p>", page, re.S))
    chapters.append([p for p in found])
  return chapters


def _change_one_word(text: str, rng: random.Random) -> str:
  """The text with one word of its middle paragraph replaced (two characters for Chinese and Japanese)."""
  lines = text.split("\n")
  middle = lines[len(lines) // 2]
  spans = [m.span() for m in re.finditer(r"[A-Za-zÀ-ÿ]{4,}", middle)]
  if spans:
    start, end = rng.choice(spans)
    lines[len(lines) // 2] = middle[:start] + "Zwischenwort"[:end - start + 2] + middle[end:]
  else:
    cjk = [m.start() for m in re.finditer(r"[\u3040-\u30ff\u4e00-\u9fff]{2}", middle)]
    start = rng.choice(cjk)
    lines[len(lines) // 2] = middle[:start] + "变更" + middle[start + 2:]
  return "\n".join(lines)


def build(directory: str, per_language: int, num_shards: int, untranslated: bool = False, seed: int = 0) -> dict:
  """Writes the corpus (shards and per-language references); returns {id: (kind, language)}."""
  rng = random.Random(seed)
  text = {lang: paragraphs(lang) for lang in LANGUAGES}
  shapes = {lang: [len(c) for c in chapters] for lang, chapters in text.items()}
  if len(set(map(tuple, shapes.values()))) != 1:
    raise SystemExit(f"the translations' paragraphs do not line up: {shapes}")
  positions = [(c, i) for c, chapter in enumerate(text["en"]) for i in range(0, len(chapter) - 2, 3)
               if len(" ".join(chapter[i:i + 3]).split()) >= 80 and (untranslated or all(
                   text[code][c][i + j] != chapter[i + j] for code in LANGUAGES if code != "en" for j in range(3)))]
  step = len(positions) / per_language
  chosen = [positions[int(k * step)] for k in range(per_language)]
  used = {(c, i + j) for c, i in chosen for j in range(3)}
  docs, labels = [], {}
  for code, lang in LANGUAGES.items():
    for c, i in chosen:
      doc_id = f"{lang}-ch{c + 1:02d}-p{i}"
      docs.append((doc_id, "\n".join(text[code][c][i:i + 3])))
      labels[doc_id] = ("real", lang)
    with open(os.path.join(directory, f"reference.{lang}.txt"), "w", encoding="utf-8") as f:
      f.writelines(p + "\n" for c, chapter in enumerate(text[code]) for i, p in enumerate(chapter)
                   if (c, i) not in used and p)
  for k, junk in enumerate(JUNK):
    docs.append((f"junk-{k}", junk))
    labels[f"junk-{k}"] = ("junk", "")
  rng.shuffle(docs)
  real = [d for d in docs if labels[d[0]][0] == "real"]
  copies = []
  for k, (doc_id, body) in enumerate(rng.sample(real, 40)):
    kind = "exact" if k < 20 else "near"
    copies.append((f"{kind}-copy-of-{doc_id}", body if kind == "exact" else _change_one_word(body, rng)))
    labels[copies[-1][0]] = (kind, labels[doc_id][1])
  rng.shuffle(copies)
  docs += copies  # after every original: "the earliest document survives" keeps the originals
  per = -(-len(docs) // num_shards)
  for s in range(num_shards):
    with open(os.path.join(directory, f"in-{s:02d}.jsonl"), "w", encoding="utf-8") as f:
      f.writelines(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n" for i, t in docs[s * per:(s + 1) * per])
  return labels


def _cpu() -> float:
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--docs-per-language", type=int, default=40)
  parser.add_argument("--shards", type=int, default=4)
  parser.add_argument("--workers", type=int, default=1)
  parser.add_argument("--untranslated", action="store_true",
                      help="also take positions where a translation left a paragraph in English (such documents are "
                           "duplicates across languages, rightly removed, and so lower the keep rates)")
  parser.add_argument("--dir", default="", help="work directory (default: a temporary one)")
  args = parser.parse_args(argv)
  missing = [code for code in LANGUAGES if not glob.glob(os.path.join(ROOT, f"ch*.{code}.html"))]
  if missing:
    print(f"notice: the Debian Reference is not installed for {', '.join(missing)} (no {ROOT}/ch*.LANG.html); "
          "install it with `apt-get install " + " ".join(f"debian-reference-{c}" for c in LANGUAGES) +
          "` to run this benchmark. Nothing was measured.")
    return 0
  root = args.dir or tempfile.mkdtemp(prefix="curate-real-")
  os.makedirs(os.path.join(root, "in"), exist_ok=True)
  labels = build(os.path.join(root, "in"), args.docs_per_language, args.shards, args.untranslated)

  cfg = curate_config.get_config()
  cfg.input = os.path.join(root, "in", "in-*.jsonl")
  cfg.output = os.path.join(root, "out")
  cfg.num_workers = args.workers
  cfg.perplexity.reference = tuple(f"{lang}={os.path.join(root, 'in', f'reference.{lang}.txt')}"
                                   for lang in LANGUAGES.values())
  t0, c0 = time.perf_counter(), _cpu()
  summary = pipeline.run(cfg)
  wall, cpu = time.perf_counter() - t0, _cpu() - c0

  kept = {}
  for path in glob.glob(os.path.join(cfg.output, "*", "*", "part-*.jsonl")):
    with open(path, encoding="utf-8") as f:
      kept.update((r["id"], r) for r in map(json.loads, f))
  by_kind: dict[str, list[str]] = {}
  for doc_id, (kind, _) in labels.items():
    by_kind.setdefault(kind, []).append(doc_id)
  keep_rate = {lang: round(sum(i in kept for i in by_kind["real"] if labels[i][1] == lang) / args.docs_per_language, 3)
               for lang in LANGUAGES.values()}
  real_kept = [i for i in by_kind["real"] if i in kept]
  right = sum(kept[i]["language"] == labels[i][1] for i in real_kept)
  wrong = {i: kept[i]["language"] for i in real_kept if kept[i]["language"] != labels[i][1]}
  originals_of_copies = [i.split("-copy-of-", 1)[1] for k in ("exact", "near") for i in by_kind[k]]
  stages = {s["stage"]: {lang: row["docs_out"] for lang, row in s["by_language"].items()} | {"all": s["docs_out"]}
            for s in summary["stages"]}
  print(json.dumps({
      "documents": len(labels),
      "keep_rate_per_language": keep_rate,
      "keep_rate_spread_points": round(100 * (max(keep_rate.values()) - min(keep_rate.values())), 1),
      "exact_copies_removed": sum(i not in kept for i in by_kind["exact"]) / len(by_kind["exact"]),
      "near_copies_removed": sum(i not in kept for i in by_kind["near"]) / len(by_kind["near"]),
      "originals_of_copies_kept": sum(i in kept for i in originals_of_copies) / len(originals_of_copies),
      "removed_as_documents_by_minhash": summary.get("minhash"),
      "paragraph_dedup": summary.get("paragraph_dedup"),
      "junk_kept": {i: kept[i]["bucket"] for i in by_kind["junk"] if i in kept},
      "junk_in_head": sum(i in kept and kept[i]["bucket"] == "head" for i in by_kind["junk"]),
      "langid_right_on_kept": round(right / max(1, len(real_kept)), 3),
      "langid_wrong": wrong,
      "quality_reasons": summary["quality_reasons"],
      "docs_out_per_stage": stages,
      "wall_s": round(wall, 1),
      "cpu_s": round(cpu, 1),
      "docs_per_s_wall": round(len(labels) / wall, 1),
      "docs_per_s_per_core": round(len(labels) / cpu, 1),
      "load_average_1min": round(os.getloadavg()[0], 1),
  }, ensure_ascii=False, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
