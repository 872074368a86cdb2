"""Multilingual text for the curation tests: English from CPython's own documentation (always installed), and
sentences written for these tests in seven more languages, Chinese and Japanese among them."""
import re

SENTENCES = {
    "de": """Der Zug nach Hamburg fährt jeden Morgen um halb sieben vom zweiten Gleis ab.
Im Winter wird es in unserem Dorf schon am späten Nachmittag dunkel.
Meine Großmutter backt am Sonntag immer einen Apfelkuchen mit viel Zimt.
Die Bibliothek der Universität bleibt während der Prüfungszeit bis Mitternacht geöffnet.
Nach dem starken Regen war der kleine Bach hinter dem Haus über die Ufer getreten.
Der neue Lehrer erklärt die Aufgaben so geduldig, dass alle Kinder ihn mögen.
Auf dem Wochenmarkt kaufen wir frisches Gemüse, Käse und Brot vom Bauernhof.
Das alte Rathaus wurde im letzten Jahr sorgfältig renoviert und neu gestrichen.
Wer die Berge liebt, sollte einmal im Herbst durch die Alpen wandern.
Die Ärztin empfahl ihm, jeden Tag mindestens eine halbe Stunde spazieren zu gehen.
Unsere Nachbarn haben einen Hund, der jeden Besucher freundlich begrüßt.
Im Museum der Stadt gibt es eine große Sammlung von Gemälden aus dem neunzehnten Jahrhundert.
Am Abend saß die ganze Familie in der Küche und erzählte sich Geschichten.
Der Bäcker an der Ecke öffnet seinen Laden schon um fünf Uhr früh.
Wegen der Baustelle auf der Brücke müssen die Autos einen langen Umweg fahren.
Sie lernt seit drei Jahren Klavier und spielt inzwischen schon kleine Stücke von Mozart.
Im Sommer schwimmen die Kinder fast jeden Nachmittag im See hinter dem Wald.
Der Computer im Büro ist so langsam, dass man beim Starten einen Kaffee trinken kann.
Auf dem Dachboden fanden wir eine Kiste mit alten Briefen und Fotografien.
Die Bauern hoffen auf Regen, denn der Sommer war bisher sehr heiß und trocken.""",
    "fr": """Le train pour Lyon part tous les matins à sept heures moins le quart du quai numéro deux.
En hiver, il fait nuit dans notre village dès la fin de l'après-midi.
Ma grand-mère prépare une tarte aux pommes chaque dimanche avec beaucoup de cannelle.
La bibliothèque de l'université reste ouverte jusqu'à minuit pendant la période des examens.
Après les fortes pluies, le petit ruisseau derrière la maison a débordé dans le jardin.
Le nouveau professeur explique les exercices avec tant de patience que tous les élèves l'apprécient.
Au marché du samedi, nous achetons des légumes frais, du fromage et du pain de la ferme.
L'ancienne mairie a été soigneusement rénovée et repeinte l'année dernière.
Ceux qui aiment la montagne devraient traverser les Alpes à pied au moins une fois en automne.
Le médecin lui a conseillé de marcher au moins une demi-heure chaque jour.
Nos voisins ont un chien qui accueille chaque visiteur en remuant joyeusement la queue.
Le musée de la ville possède une grande collection de tableaux du dix-neuvième siècle.
Le soir, toute la famille s'est réunie dans la cuisine pour se raconter des histoires.
Le boulanger du coin ouvre sa boutique dès cinq heures du matin.
À cause des travaux sur le pont, les voitures doivent faire un long détour par la forêt.
Elle apprend le piano depuis trois ans et joue déjà de petits morceaux de Mozart.
En été, les enfants se baignent presque tous les après-midi dans le lac derrière le bois.
L'ordinateur du bureau est si lent qu'on a le temps de boire un café pendant le démarrage.
Dans le grenier, nous avons trouvé une caisse remplie de vieilles lettres et de photographies.
Les agriculteurs espèrent la pluie, car l'été a été jusqu'ici très chaud et très sec.""",
    "es": """El tren a Sevilla sale todas las mañanas a las siete menos cuarto desde el andén dos.
En invierno, en nuestro pueblo ya es de noche a última hora de la tarde.
Mi abuela prepara una tarta de manzana cada domingo con mucha canela.
La biblioteca de la universidad permanece abierta hasta medianoche durante la época de exámenes.
Después de las fuertes lluvias, el pequeño arroyo detrás de la casa se desbordó sobre el huerto.
El nuevo profesor explica los ejercicios con tanta paciencia que todos los alumnos lo aprecian.
En el mercado del sábado compramos verduras frescas, queso y pan de la granja.
El antiguo ayuntamiento fue restaurado con mucho cuidado y pintado de nuevo el año pasado.
Quien ame las montañas debería cruzar los Pirineos a pie al menos una vez en otoño.
La médica le recomendó caminar por lo menos media hora todos los días.
Nuestros vecinos tienen un perro que saluda a cada visitante moviendo la cola con alegría.
El museo de la ciudad tiene una gran colección de cuadros del siglo diecinueve.
Por la noche, toda la familia se reunió en la cocina para contarse historias.
El panadero de la esquina abre su tienda a las cinco de la mañana.
Por las obras en el puente, los coches tienen que dar un largo rodeo por el bosque.
Ella estudia piano desde hace tres años y ya toca pequeñas piezas de Mozart.
En verano, los niños se bañan casi todas las tardes en el lago detrás del bosque.
El ordenador de la oficina es tan lento que da tiempo a tomar un café mientras arranca.
En el desván encontramos una caja llena de cartas antiguas y fotografías.
Los agricultores esperan la lluvia, porque hasta ahora el verano ha sido muy caluroso y seco.""",
    "it": """Il treno per Firenze parte ogni mattina alle sette meno un quarto dal binario due.
D'inverno, nel nostro paese fa buio già nel tardo pomeriggio.
Mia nonna prepara una torta di mele ogni domenica con tanta cannella.
La biblioteca dell'università resta aperta fino a mezzanotte durante il periodo degli esami.
Dopo le forti piogge, il piccolo torrente dietro la casa è straripato nell'orto.
Il nuovo insegnante spiega gli esercizi con tanta pazienza che tutti gli studenti lo apprezzano.
Al mercato del sabato compriamo verdure fresche, formaggio e pane della fattoria.
Il vecchio municipio è stato restaurato con cura e ridipinto l'anno scorso.
Chi ama la montagna dovrebbe attraversare le Dolomiti a piedi almeno una volta in autunno.
Il medico gli ha consigliato di camminare almeno mezz'ora ogni giorno.
I nostri vicini hanno un cane che accoglie ogni visitatore scodinzolando felice.
Il museo della città possiede una grande collezione di dipinti dell'Ottocento.
La sera tutta la famiglia si è riunita in cucina per raccontarsi delle storie.
Il fornaio all'angolo apre il suo negozio già alle cinque del mattino.
A causa dei lavori sul ponte, le automobili devono fare una lunga deviazione attraverso il bosco.
Lei studia pianoforte da tre anni e suona già piccoli brani di Mozart.
D'estate i bambini fanno il bagno quasi ogni pomeriggio nel lago dietro il bosco.
Il computer dell'ufficio è così lento che si fa in tempo a bere un caffè durante l'avvio.
In soffitta abbiamo trovato una cassa piena di vecchie lettere e fotografie.
Gli agricoltori sperano nella pioggia, perché finora l'estate è stata molto calda e secca.""",
    "pt": """O comboio para o Porto parte todas as manhãs às sete menos um quarto da linha dois.
No inverno, na nossa aldeia já é noite ao fim da tarde.
A minha avó faz uma tarte de maçã todos os domingos com muita canela.
A biblioteca da universidade fica aberta até à meia-noite durante a época de exames.
Depois das chuvas fortes, o pequeno ribeiro atrás da casa transbordou para a horta.
O novo professor explica os exercícios com tanta paciência que todos os alunos gostam dele.
No mercado de sábado compramos legumes frescos, queijo e pão da quinta.
A antiga câmara municipal foi cuidadosamente restaurada e pintada de novo no ano passado.
Quem gosta de montanhas deveria atravessar a serra a pé pelo menos uma vez no outono.
A médica aconselhou-o a caminhar pelo menos meia hora todos os dias.
Os nossos vizinhos têm um cão que recebe cada visitante abanando a cauda com alegria.
O museu da cidade tem uma grande coleção de pinturas do século dezanove.
À noite, a família inteira juntou-se na cozinha para contar histórias.
O padeiro da esquina abre a sua loja logo às cinco da manhã.
Por causa das obras na ponte, os carros têm de fazer um grande desvio pela floresta.
Ela aprende piano há três anos e já toca pequenas peças de Mozart.
No verão, as crianças tomam banho quase todas as tardes no lago atrás do bosque.
O computador do escritório é tão lento que dá tempo para beber um café enquanto arranca.
No sótão encontrámos uma caixa cheia de cartas antigas e fotografias.
Os agricultores esperam pela chuva, porque até agora o verão tem sido muito quente e seco.""",
    "ja": """大阪行きの電車は毎朝六時四十五分に二番線から出発します。
冬になると、私たちの村では夕方早くから暗くなります。
祖母は毎週日曜日にシナモンをたっぷり入れたりんごのケーキを焼きます。
大学の図書館は試験期間中、夜の十二時まで開いています。
大雨のあと、家の裏の小さな川があふれて畑まで水が来ました。
新しい先生はとても丁寧に問題を説明してくれるので、生徒たちに人気があります。
土曜日の市場では、農家から新鮮な野菜やチーズやパンを買います。
古い市役所は去年きれいに改装され、壁も塗り直されました。
山が好きな人は、一度は秋のアルプスを歩いて越えてみるべきです。
医者は彼に、毎日少なくとも三十分は散歩するように勧めました。
隣の家の犬は、訪ねてくる人をいつもしっぽを振って迎えてくれます。
町の美術館には十九世紀の絵画がたくさん集められています。
夜になると、家族みんなが台所に集まっていろいろな話をしました。
角のパン屋さんは朝五時にはもう店を開けています。
橋の工事のせいで、車は森を通る長い回り道をしなければなりません。
彼女は三年前からピアノを習っていて、もうモーツァルトの小品を弾けます。
夏には子どもたちがほとんど毎日、森の向こうの湖で泳いでいます。
事務所のパソコンはとても遅いので、起動を待つ間にコーヒーが一杯飲めます。
屋根裏部屋で、古い手紙や写真がいっぱい詰まった箱を見つけました。
今年の夏はずっと暑くて雨が少なかったので、農家の人たちは雨を待っています。""",
    "zh": """开往上海的火车每天早上六点四十五分从二号站台出发。
到了冬天，我们村子里下午很早天就黑了。
奶奶每个星期天都会做一个放了很多肉桂的苹果蛋糕。
考试期间，大学图书馆一直开到晚上十二点。
下了几天大雨以后，房子后面的小河涨水，淹到了菜地里。
新来的老师讲题目非常耐心，所以学生们都很喜欢他。
星期六的集市上，我们从农民那里买新鲜的蔬菜、奶酪和面包。
老市政厅去年经过仔细的修缮，墙壁也重新粉刷了一遍。
喜欢爬山的人，秋天的时候一定要去山里走一走。
医生建议他每天至少散步半个小时。
邻居家的狗见到每一个来访的客人都会高兴地摇尾巴。
城里的博物馆收藏了很多十九世纪的油画。
晚上，全家人坐在厨房里，一边喝茶一边讲故事。
街角的面包店早上五点就开门了。
因为桥上正在施工，汽车只好绕一条穿过森林的远路。
她学钢琴已经三年了，现在已经能弹莫扎特的小曲子。
夏天，孩子们几乎每天下午都在树林后面的湖里游泳。
办公室的电脑慢得很，开机的时候足够喝完一杯咖啡。
我们在阁楼上找到了一个装满旧信件和老照片的箱子。
今年夏天又热又干，农民们都盼着早点下雨。""",
}
SENTENCES = {lang: text.split("\n") for lang, text in SENTENCES.items()}

# What a crawler keeps of a site's navigation: no prose.
JUNK = [
    "Home | Download | Support | Contact | Search\nPrevious | Up | Next | Table of contents\nPrivacy policy | "
    "Terms of use | Cookies",
    "Startseite | Über uns | Produkte | Kontakt | Impressum\nDatenschutz | AGB | Cookie-Einstellungen | Login",
    "首页 | 新闻 | 下载 | 联系我们\n隐私政策 | 使用条款 | 网站地图 | 登录 | 注册",
    "ホーム | ニュース | ダウンロード | お問い合わせ\nプライバシーポリシー | 利用規約 | サイトマップ",
]


def english_paragraphs() -> list[str]:
  """Prose paragraphs of the Python reference manual (pydoc_data.topics): blank-line separated blocks of plain
  sentences (no code, no lists, no tables), each joined into one line."""
  from pydoc_data import topics
  out = []
  for key in sorted(topics.topics):
    for block in re.split(r"\n\s*\n", topics.topics[key]):
      lines = block.split("\n")
      if any(line.startswith((" ", "\t", "*", "-", "+", "=", "|")) for line in lines):
        continue
      text = " ".join(" ".join(lines).split())
      if len(text.split()) >= 30 and text[0].isupper() and text.endswith(".") and ">>>" not in text:
        out.append(text)
  return out


def output_records(out) -> list[dict]:
  """Every record a curation run wrote (its DIR/<lang>/<bucket>/*.jsonl files; _work excluded), in path order."""
  import json
  import os
  records = []
  for root, dirs, names in os.walk(out):
    dirs.sort()
    if "_work" in os.path.relpath(root, out).split(os.sep):
      continue
    for name in sorted(names):
      if name.endswith(".jsonl"):
        with open(os.path.join(root, name), encoding="utf-8") as f:
          records += [json.loads(line) for line in f]
  return records


def output_tree(out) -> dict[str, bytes]:
  """{relative path: bytes} of every output file of a curation run (_work excluded)."""
  import os
  files = {}
  for root, _, names in os.walk(out):
    rel = os.path.relpath(root, out)
    if rel.split(os.sep)[0] == "_work":
      continue
    for name in names:
      with open(os.path.join(root, name), "rb") as f:
        files[os.path.normpath(os.path.join(rel, name))] = f.read()
  return files


def curate_input_config(input_glob, out, **sections):
  """The curation config with `input`/`output` set, one worker, and the given `section.key` values: a test's run."""
  from configs import curate as curate_config
  cfg = curate_config.get_config()
  cfg.input, cfg.output, cfg.num_workers = str(input_glob), str(out), 1
  for key, value in sections.items():
    section, name = key.split("__")
    cfg[section][name] = value
  return cfg
