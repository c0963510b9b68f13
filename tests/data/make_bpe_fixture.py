#!/usr/bin/env python3
"""Makes the BPE fixtures that tests/data/tokenizer_test.cpp checks the C++ tokenizer against.
Needs the `tokenizers` (>= 0.19) and `transformers` packages (no network).

    python3 tests/data/make_bpe_fixture.py [--out tests/data/fixtures/bpe] [CORPUS.txt ...]

Trains small BPE tokenizers (vocab 1000) with `tokenizers` on the corpus files (default: the
docstrings of Python's standard library, which every Python install has):
  gpt2/    ByteLevel pre-tokenizer (the GPT-2 regex), special token <|endoftext|>, plus an added
           token "<mask>" with lstrip and a non-special added token "[CUSTOM]"
  llama3/  Split(Llama 3 regex, isolated) + ByteLevel(use_regex=False), ignore_merges=True,
           special tokens <|begin_of_text|> and <|end_of_text|>
  qwen2/   Qwen2/Qwen3's layout: NFC normalizer, Split(Qwen2 regex: digits one by one, isolated) +
           ByteLevel(use_regex=False), ByteLevel decoder, specials <|endoftext|> <|im_start|>
           <|im_end|>
  spm_bpe/ Llama 2 / Mistral's SentencePiece-style layout: normalizer Sequence[Prepend("▁"),
           Replace(" ", "▁")], no pre-tokenizer, BPE with byte_fallback, fuse_unk and unk_token
           <unk>, decoder Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)];
           <unk> <s> </s> are ids 0..2 and <0x00>..<0xFF> ids 3..258 (vocab entries, not added
           tokens, as in real checkpoints); the training text lacks CJK, emoji, Arabic, ... so
           those characters fall back to byte tokens
  spm_metaspace/  the same model, vocab and decoder in the newer conversion's layout
           (transformers' legacy=False): no normalizer, Metaspace pre-tokenizer
           (prepend_scheme "first", split false)
The qwen2 and spm variants also train on a few lines of accented Latin and Cyrillic
(EXTRA_TRAINING_TEXT), so some non-ASCII characters are in their vocab and others are not.
Writes for each OUT/<variant>/tokenizer.json and OUT/<variant>/expected.json:
  {"variant": ..., "tokenizers_version": ..., "cases": [{"text": ..., "ids": [...],
   "decoded": ...}, ...]}
where ids = Tokenizer.encode(text, add_special_tokens=False).ids (checked equal to
transformers' PreTrainedTokenizerFast) and decoded = decode(ids, skip_special_tokens=False).
"""
import argparse
import json
import importlib
import os
import sys

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        trainers)

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
SPM_BYTE_TOKENS = ["<0x%02X>" % b for b in range(256)]

EXTRA_TRAINING_TEXT = [
    "café naïve résumé déjà vu über straße façade élève à la carte\n",
    "Привет, мир! Как дела? Хорошо, спасибо.\n",
    "Ελληνικά: καλημέρα κόσμε\n",
] * 20

TEST_STRINGS = [
    "",
    "Hello world",
    "Hello, world! How are you doing today?",
    "the quick brown fox jumps over the lazy dog",
    "THE QUICK BROWN FOX",
    "It's, I'm, you're, we've, they'll, he'd, don't; IT'S I'M YOU'RE THEY'LL",
    "Numbers: 0 7 42 123 1234 12345 3.14159 1,000,000 2024-05-01 +1e-10",
    "Punctuation!!! ... ??? ,,, ;;; (parens) [brackets] {braces} <angle> \"quotes\" 'single'",
    "def f(x):\n    return x ** 2  # comment\n\n\nprint(f(3))\n",
    "tabs\tand\t\tmore\ttabs",
    "trailing spaces   ",
    "   leading spaces",
    "many     spaces     between",
    "line one\nline two\r\nline three\n\n\n  indented\n",
    "naïve café 日本語 🙂",
    "Ünïcödé: Ελληνικά, русский, עברית, العربية, हिन्दी, 한국어, ไทย",
    "emoji 🙂🙃😀 👍🏽 🇫🇷 family: 👨‍👩‍👧",
    "non-breaking\u00a0space, ideographic\u3000space, em\u2003space, zero\u200bwidth",
    "next\u0085line  \u0085 x \u3000\u0085y bom\ufeffz \ufeff w",
    "fractions ½ ¾ superscripts ² ³ roman Ⅻ circled ①②",
    "ſome long s 'ſ and KELVIN \u212a",
    "mixed123abc 123abc abc123 a1b2c3",
    "a" * 300,
    "=" * 100 + "\n" + "-" * 50,
    "https://example.com/path?query=1&x=y#frag user@example.com",
    "<|endoftext|>",
    "Hello<|endoftext|>World",
    "end of doc.<|endoftext|>\nNext doc begins here.",
    "<|begin_of_text|>Hello<|end_of_text|>",
    "a <mask> here and<mask>there  <mask>  ok",
    "custom [CUSTOM] token and[CUSTOM]glued",
    "<|endoftext|><|endoftext|> twice",
    # Multilingual and Unicode-normalization cases (issue 20: Qwen2 and SentencePiece layouts).
    "1234567 and 3.14 and 0.5% of 10,000,000 and ١٢٣ and ４５６",
    "中文分词测试：我们今天去北京。",
    "日本語のテキストです。カタカナ、ひらがな、漢字。",
    "한국어 텍스트입니다. 안녕하세요!",
    "مرحبا بالعالم، كيف حالك؟",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "emoji 👩🏽‍💻 👨‍👩‍👧‍👦 👍🏿 🏳️‍🌈 ❤️ 🇯🇵 🙂",
    "NFC é and NFD e\u0301 and Å vs A\u030a vs \u212b",
    "Hangul 한 vs \u1112\u1161\u11ab, ligature ﬁ, width ｶﾀｶﾅ, ohm \u2126",
    "café vs cafe\u0301 vs CAFÉ vs CAFE\u0301",
    " \t \n\n\t  \r\n   x  \n  ",
    "a  b   c    d\t\te\n\n\nf   ",
    "   ",
    " ",
    "\n",
    "I'm sure you'll see they've done what we'd said; DON'T, CAN'T, Y'ALL'D'VE",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "x = {'k': [1, 2.5, -3e4], \"s\": None}  # dict\n",
    "literal ▁ metaspace ▁▁ and <0x41> byte token text and <unk> here",
    "<s>Hello</s> world<s> again",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "control \x00 \x07 \x1b[0m \x7f chars",
]


STDLIB_MODULES = """
os re json collections itertools functools typing pathlib argparse logging unittest email
http.client urllib.parse subprocess threading asyncio datetime decimal fractions statistics random
string textwrap difflib inspect dataclasses enum socket ssl sqlite3 csv zipfile tarfile shutil
tempfile pickle copy pprint heapq bisect array struct codecs unicodedata locale gettext optparse
configparser xml.dom.minidom html.parser base64 hashlib hmac secrets time calendar math cmath
operator contextlib abc io glob fnmatch queue sched select signal mmap multiprocessing
concurrent.futures doctest pdb trace timeit cProfile pydoc ast dis tokenize keyword importlib
warnings traceback gc weakref types builtins
""".split()


def stdlib_corpus():
    """Docstrings of a fixed list of standard library modules: English prose and code, offline."""
    import warnings
    warnings.simplefilter("ignore")
    texts, seen = [], set()

    def add(obj, depth):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and len(doc) > 40:
            texts.append(doc)
        if depth < 2:
            for name in sorted(vars(obj)) if hasattr(obj, "__dict__") else []:
                if not name.startswith("_"):
                    member = getattr(obj, name, None)
                    if callable(member) or isinstance(member, type):
                        add(member, depth + 1)

    for name in STDLIB_MODULES:
        try:
            add(importlib.import_module(name), 0)
        except Exception:
            pass
    return texts


def spm_layout(tok, json_text, metaspace):
    """The trained SentencePiece-style tokenizer rewritten into Llama 2 / Mistral's layout."""
    j = json.loads(json_text)
    # The byte tokens were trainer specials (so they got ids 3..258); real checkpoints have them
    # as plain vocab entries, only <unk> <s> </s> as added tokens.
    j["added_tokens"] = [t for t in j["added_tokens"] if t["content"] in SPM_SPECIALS]
    vocab = j["model"]["vocab"]
    for i, name in enumerate(SPM_SPECIALS + SPM_BYTE_TOKENS):
        if vocab.get(name) != i:
            sys.exit(f"spm: {name} has id {vocab.get(name)}, expected {i}")
    if metaspace:  # transformers' LlamaConverter with legacy=False
        j["normalizer"] = None
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                              "prepend_scheme": "first", "split": False}
    else:  # legacy=True, as the Llama 2 and Mistral checkpoints ship it
        j["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        j["pre_tokenizer"] = None
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(j, ensure_ascii=False))


def train_spm(corpus_files, corpus_texts):
    """BPE over Metaspace words (each word starts with "▁"), as SentencePiece learns it."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPM_SPECIALS + SPM_BYTE_TOKENS,
                                  show_progress=False)
    if corpus_files:
        tok.train(corpus_files, trainer)
    else:
        tok.train_from_iterator(corpus_texts + EXTRA_TRAINING_TEXT, trainer)
    return tok


def train(variant, corpus_files, corpus_texts):
    if variant == "qwen2":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        if corpus_files:
            tok.train(corpus_files, trainer)
        else:
            tok.train_from_iterator(corpus_texts + EXTRA_TRAINING_TEXT, trainer)
        return tok
    if variant == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials = ["<|endoftext|>"]
    else:
        try:
            model = models.BPE(ignore_merges=True)
        except TypeError:
            sys.exit("this tokenizers version has no BPE(ignore_merges=...); need >= 0.19")
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if corpus_files:
        tok.train(corpus_files, trainer)
    else:
        tok.train_from_iterator(corpus_texts, trainer)
    if variant == "gpt2":
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
        tok.add_tokens([AddedToken("[CUSTOM]", special=False)])
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "fixtures", "bpe"))
    ap.add_argument("corpus", nargs="*", help="text files to train on (default: stdlib docstrings)")
    args = ap.parse_args()
    texts = None if args.corpus else stdlib_corpus()
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        PreTrainedTokenizerFast = None
        print("warning: transformers not installed; not cross-checking", file=sys.stderr)

    spm = None
    for variant in ("gpt2", "llama3", "qwen2", "spm_bpe", "spm_metaspace"):
        if variant.startswith("spm"):
            spm = spm or train_spm(args.corpus, texts)
            tok = spm_layout(spm, spm.to_str(), metaspace=variant == "spm_metaspace")
        else:
            tok = train(variant, args.corpus, texts)
        out_dir = os.path.join(args.out, variant)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "tokenizer.json")
        tok.save(path)
        tok = Tokenizer.from_file(path)  # test what was saved
        hf = PreTrainedTokenizerFast(tokenizer_file=path) if PreTrainedTokenizerFast else None
        cases = []
        for text in TEST_STRINGS:
            ids = tok.encode(text, add_special_tokens=False).ids
            if hf is not None:
                hf_ids = hf.encode(text, add_special_tokens=False)
                if hf_ids != ids:
                    sys.exit(f"{variant}: tokenizers and transformers disagree on {text!r}")
            decoded = tok.decode(ids, skip_special_tokens=False)
            cases.append({"text": text, "ids": ids, "decoded": decoded})
        if variant.startswith("spm"):
            # The fixture must exercise byte fallback and also multi-byte characters in the vocab.
            if not any(3 <= i <= 258 for c in cases for i in c["ids"]):
                sys.exit(f"{variant}: no test string fell back to byte tokens")
            if tok.token_to_id("é") is None:
                sys.exit(f"{variant}: 'é' is not in the vocab; EXTRA_TRAINING_TEXT was not used")
        with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8") as f:
            json.dump({"variant": variant, "tokenizers_version": tokenizers.__version__,
                       "vocab_size": tok.get_vocab_size(with_added_tokens=True), "cases": cases},
                      f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {path} (vocab {tok.get_vocab_size(with_added_tokens=True)}) and "
              f"{len(cases)} cases to {out_dir}/expected.json")


if __name__ == "__main__":
    main()
