#!/usr/bin/env python3
"""Makes the byte-level BPE fixtures that tests/data/tokenizer_test.cpp checks the C++ tokenizer
against. Needs the `tokenizers` and `transformers` packages (no network).

    python3 tests/data/make_bpe_fixture.py [--out tests/data/fixtures/bpe] [CORPUS.txt ...]

Trains two small byte-level BPE tokenizers (vocab 1000) with `tokenizers` on the corpus files
(default: the docstrings of Python's standard library, which every Python install has):
  gpt2/    ByteLevel pre-tokenizer (the GPT-2 regex), special token <|endoftext|>, plus an added
           token "<mask>" with lstrip and a non-special added token "[CUSTOM]"
  llama3/  Split(Llama 3 regex, isolated) + ByteLevel(use_regex=False), ignore_merges=True,
           special tokens <|begin_of_text|> and <|end_of_text|>
and writes for each OUT/<variant>/tokenizer.json and OUT/<variant>/expected.json:
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
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers, AddedToken

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

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


def train(variant, corpus_files, corpus_texts):
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

    for variant in ("gpt2", "llama3"):
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
        with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8") as f:
            json.dump({"variant": variant, "tokenizers_version": tokenizers.__version__,
                       "vocab_size": tok.get_vocab_size(with_added_tokens=True), "cases": cases},
                      f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {path} (vocab {tok.get_vocab_size(with_added_tokens=True)}) and "
              f"{len(cases)} cases to {out_dir}/expected.json")


if __name__ == "__main__":
    main()
