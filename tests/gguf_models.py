"""What the GGUF tests export besides tiny_runs.make_run: a trained tokenizer, and text that is hard to split the
same way twice."""

from k3.formats.tokenizer import K3Tokenizer, train_tokenizer

TRICKY = [
    "def f(x):\n    return x**2  # square\n\n\tpass\n",
    "Hello world!!  It's   we're they've I'm you'll he'd 'S DON'T x's it’s '''s",
    "12345 3.14159 1,000,000 x2y3 ²³ ½ Ⅻ ٣٤ 一二三 0x1F",
    "   leading and trailing   ",
    "\n\n\n a\u00a0b a \u3000 b tab\t\tsep\r\n\r\n  \n  x \t x",
    "naïve café 日本語のテキスト 한국어 Ελληνικά русский עברית العربية",
    "emoji 👍🏽 🇺🇸 👨\u200d👩\u200d👧 e\u0301 a\u0308 $$$ ... --> <= !== ;;",
    '{"key": [1, 2.5e-3, null], \'v\': "a b"}  \u2028\u2029\u0085end',
    "",
    " ",
    "x",
]


def trained_tokenizer() -> K3Tokenizer:
    corpus = [t * 3 for t in TRICKY] + ["def g(y):\n    return y + 1\n" * 4, "the cat sat on the mat. " * 6]
    return train_tokenizer(corpus * 4, vocab_size=400)
