// Prints a deterministic JSON array of tokenizer test strings (>= 2,000): hand-written
// edge cases, then random mixes of scripts, emoji, whitespace, numbers, contractions,
// punctuation and special tokens. Only code points assigned since Unicode 14 or earlier
// are used, so the reference's and PCRE2's Unicode tables agree.
//   node gen_strings.mjs [COUNT=2000] [SEED=20240611]
const count = Number(process.argv[2] ?? 2000);
let seed = Number(process.argv[3] ?? 20240611) >>> 0;

// mulberry32
function random() {
  seed = (seed + 0x6d2b79f5) >>> 0;
  let t = seed;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const int = (lo, hi) => lo + Math.floor(random() * (hi - lo + 1));
const pick = (xs) => xs[int(0, xs.length - 1)];
const cp = (lo, hi) => String.fromCodePoint(int(lo, hi));
const run = (f, lo, hi) => Array.from({ length: int(lo, hi) }, f).join('');

const SPECIAL = ['<|begin_of_text|>', '<|end_of_text|>', '<|eot_id|>', '<|endoftext|>',
  '<|im_start|>', '<|im_end|>', '<think>', '</think>', '<tool_call>', '<s>', '</s>',
  '<unk>', '<|startoftext|>', '<|return|>', '<|channel|>', '<|message|>',
  '<|reserved_special_token_5|>', '<|im_sta', '<|end', '<<s>>', '<|', '|>'];
const CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE",
  "'M", "'LL", "'D", "'Ll", "n't", "N'T", "'", "''"];
const WORDS = ['the', 'quick', 'brown', 'fox', 'Hello', 'WORLD', 'tokenizer', 'Llama',
  'GPT', 'naïve', 'café', 'résumé', 'Straße', 'über', 'don', 'I', 'a', 'x', 'camelCase',
  'snake_case', 'HTTPServer', 'iPhone', 'McDonald'];
const WS = [' ', ' ', ' ', '\t', '\n', '\r\n', '\r', '\u00a0', '\u3000', '\u2003', '\u0085',
  '\u2028', '\v', '\f'];
const PUNCT = '.,;:!?-_()[]{}<>/\\|@#$%^&*+=~`"\'«»…—–¿¡·•';
const EMOJI_ZWJ = ['👨‍👩‍👧‍👦', '👩🏽‍💻', '🏳️‍🌈', '🧑‍🤝‍🧑', '❤️‍🔥', '👁️‍🗨️', '🇯🇵', '🇺🇸',
  '1️⃣', '©️', '☺️', '✌🏿'];

const FRAGMENTS = [
  () => pick(WORDS),
  () => pick(WORDS).toUpperCase(),
  () => pick(WORDS) + pick(CONTRACTIONS),
  () => pick(CONTRACTIONS),
  () => run(() => cp(0x30, 0x39), 1, 25),
  () => `${int(0, 99999)}.${int(0, 999)}`,
  () => run(() => pick(WS), 1, 8),
  () => ' '.repeat(int(1, 24)),
  () => run(() => pick(PUNCT), 1, 5),
  () => run(() => cp(0x4e00, 0x9fa5), 1, 10),          // CJK
  () => run(() => cp(0x3041, 0x3096), 1, 8),           // Hiragana
  () => run(() => cp(0x30a1, 0x30fa), 1, 8),           // Katakana
  () => run(() => cp(0xac00, 0xd7a3), 1, 6),           // Hangul syllables
  () => run(() => cp(0x1100, 0x1112) + cp(0x1161, 0x1175), 1, 3),  // Hangul jamo (NFC)
  () => run(() => cp(0x1f600, 0x1f64f), 1, 4),         // emoji
  () => cp(0x1f44a, 0x1f450) + cp(0x1f3fb, 0x1f3ff),   // emoji + skin tone
  () => pick(EMOJI_ZWJ),
  () => pick('aeiouAEIOUnc') + run(() => cp(0x300, 0x36f), 1, 3),  // combining marks
  () => run(() => cp(0x430, 0x44f), 2, 9),             // Cyrillic
  () => run(() => cp(0x3b1, 0x3c9), 2, 9),             // Greek
  () => run(() => cp(0x627, 0x64a), 2, 8),             // Arabic
  () => run(() => cp(0x5d0, 0x5ea), 2, 8),             // Hebrew
  () => run(() => cp(0x915, 0x939) + pick(['', '\u093f', '\u094d', '\u0902']), 1, 5),
  () => run(() => cp(0xe01, 0xe2e), 2, 8),             // Thai
  () => run(() => cp(0xc0, 0xff), 1, 5),               // Latin-1 letters
  () => run(() => cp(0x2190, 0x22ff), 1, 3),           // arrows, math
  () => run(() => cp(0xff10, 0xff5a), 1, 4),           // full-width
  () => run(() => cp(0x1d400, 0x1d433), 1, 3),         // math alphanumerics
  () => pick(['\u017f', '\u212a', '\u0130', '\u0131', 'ǅ', 'ß', 'ﬁ', '\u00ad', '\u200b',
              '\u200d', '\ufeff', '\u2060', '\u0000', '\u0007', '\u001b', '\u007f']),
  () => pick(SPECIAL),
];

const fixed = [
  '', ' ', '  ', '   ', '\n', '\n\n', '\t', ' \n ', '\r\n', 'a', 'Hello world',
  'Hello world ', ' Hello world', '  Hello   world  ', 'hello\tworld\n', "I'm", "you're",
  "they've", "we'll", "he'd", "it's", "don't", "DON'T", "I'M", "WE'LL", "She'S", "x'll",
  "'s", "''", "'", "ſ's", "'ſ", "'\u212a", "it\u2019s", '1234567890',
  '12345678901234567890123', '3.14159', '1,000,000', '2024-06-11', '0x1F', '1e-9',
  '!!!???...', '(a) [b] {c}', '#$%&*', 'https://example.com/a?b=c&d=e',
  'def f(x):\n    return x**2\n', '    indented\n\tTabbed\n', 'a' + ' '.repeat(20) + 'b',
  'end   ', '\r\n\r\n', '\u00a0', '\u3000', '\u2028', '\u0085', 'a\u0085b', 'a\ufeffb',
  '你好世界', '日本語のテキスト', '한국어 텍스트', '😀', '👨‍👩‍👧‍👦', '🏳️‍🌈', '👍🏽',
  'e\u0301', 'a\u0308', '\u1100\u1161', 'A\u030a', 'Å', 'ﬁ', 'مرحبا بالعالم', 'שלום',
  'नमस्ते दुनिया', 'สวัสดีครับ', 'Привет, мир!', 'Γειά σου Κόσμε', 'Hello 世界 🌍 мир!',
  '<|begin_of_text|>hi', 'a<s>b', '<s>', '</s>', '<unk>', ' <s> ', '<|im_start|>user\nhi<|im_end|>',
  '<think>x</think>', '<|im_start', '<<s>>', '<|endoftext|><|endoftext|>',
  '<|reserved_special_token_250|>', '<|return|>', 'x<|eot_id|>y', '▁', '▁▁a ▁',
  '<0x41>', 'Ġ', 'ĠĠ', 'Ċ', 'a'.repeat(300), 'ab'.repeat(150), ' '.repeat(100),
  '\n'.repeat(30), '9'.repeat(100), '😀'.repeat(40), '你'.repeat(80),
];

const strings = [...fixed];
while (strings.length < count + fixed.length) {
  const parts = Array.from({ length: int(1, 12) }, () => pick(FRAGMENTS)());
  // Random joints: nothing, a space, or the parts as they are.
  let s = parts.map((p) => p + (random() < 0.4 ? ' ' : '')).join('');
  if (random() < 0.15) s = ' ' + s;
  if (random() < 0.15) s = s + pick(WS);
  strings.push(s);
}
process.stdout.write(JSON.stringify(strings));
