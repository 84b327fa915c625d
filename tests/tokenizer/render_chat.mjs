// Renders conversations with a Hugging Face chat_template: the reference of
// engine/data/chat_template's RenderChat.
//
//   node render_chat.mjs NPM_DIR MODEL_DIR CONVERSATIONS_JSON [OPTIONS_JSON]
// NPM_DIR holds node_modules/@huggingface/jinja (setup.sh installs it with transformers);
// MODEL_DIR holds tokenizer_config.json, whose chat_template, bos_token and eos_token are
// used; CONVERSATIONS_JSON is a JSON array of conversations, each an array of
// {"role", "content"}. OPTIONS_JSON is an object:
//   add_generation_prompt  (default false)
//   date                   "YYYY-MM-DD" that strftime_now formats (default "2025-06-01"),
//                          so templates that print today's date render the same every day
//   template_file          a Jinja file to use instead of tokenizer_config's chat_template
//   any other key          passed to the template as is (enable_thinking,
//                          reasoning_effort, ...)
// Output (stdout): a JSON array, one {"text": "..."} or {"error": "..."} (what the
// template raised) per conversation. Exit 3 when there is no template to render.
//
// transformers renders templates with Python's jinja2, where s.strip(chars) strips only
// `chars` and strip() strips what str.isspace() calls whitespace; @huggingface/jinja
// ignores the argument and strips JavaScript whitespace. Qwen3's template relies on
// lstrip('\n') keeping spaces, so this script gives the string methods Python's meaning.
// (The `trim` filter keeps JavaScript's: it differs only on U+001C..U+001F, U+0085 and
// U+FEFF, which the conversations avoid.)
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const [npmDir, modelDir, conversationsPath, optionsJson] = process.argv.slice(2);
if (!conversationsPath) {
  console.error('usage: node render_chat.mjs NPM_DIR MODEL_DIR CONVERSATIONS_JSON [OPTIONS_JSON]');
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(npmDir), 'package.json'));
const { Environment, Template } =
    await import(pathToFileURL(require.resolve('@huggingface/jinja')).href);

const { add_generation_prompt = false, date = '2025-06-01', template_file, ...extra } =
    JSON.parse(optionsJson ?? '{}');
const config = JSON.parse(readFileSync(path.join(modelDir, 'tokenizer_config.json'), 'utf8'));
const source = template_file ? readFileSync(template_file, 'utf8') : config.chat_template;
if (typeof source !== 'string') {
  console.error(`${modelDir}/tokenizer_config.json has no chat_template; pass template_file`);
  process.exit(3);
}
// A token is a string or an AddedToken object; null when the config has none.
const tokenText = (token) => (token && typeof token === 'object' ? token.content : token) ?? '';

// Python's str.strip / lstrip / rstrip, on code points.
const PY_SPACE =
    /^[\t\n\v\f\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$/u;
function pyStrip(text, chars, left, right) {
  const strippable = chars == null ? (c) => PY_SPACE.test(c) : (c) => [...chars].includes(c);
  const points = [...text];
  let begin = 0;
  let end = points.length;
  while (left && begin < end && strippable(points[begin])) ++begin;
  while (right && end > begin && strippable(points[end - 1])) --end;
  return points.slice(begin, end).join('');
}
const probe = new Environment();
probe.set('probe', '');
const StringValue = probe.lookupVariable('probe').constructor;
const builtins = Object.getOwnPropertyDescriptor(StringValue.prototype, 'builtins').get;
Object.defineProperty(StringValue.prototype, 'builtins', {
  get() {
    const methods = builtins.call(this);
    const FunctionValue = methods.get('strip').constructor;
    for (const [name, left, right] of [['strip', true, true], ['lstrip', true, false],
                                       ['rstrip', false, true]]) {
      methods.set(name, new FunctionValue((args) => new StringValue(
          pyStrip(this.value, args[0]?.value ?? null, left, right))));
    }
    return methods;
  },
});

// strftime_now at midnight of `date`, for the formats chat templates use. It replaces the
// renderer's own, which reads the clock.
const set = Environment.prototype.set;
Environment.prototype.set = function (name, value) {
  if (name === 'strftime_now') this.variables.delete(name);
  return set.call(this, name, value);
};
const [year, month, day] = date.split('-').map(Number);
const fixed = new Date(Date.UTC(year, month - 1, day));
const MONTHS = ['January', 'February', 'March', 'April', 'May', 'June', 'July', 'August',
                'September', 'October', 'November', 'December'];
const pad2 = (n) => String(n).padStart(2, '0');
const strftimeNow = (format) => format.replace(/%[YmdbBHM%]/g, (code) => ({
  '%Y': String(fixed.getUTCFullYear()), '%m': pad2(fixed.getUTCMonth() + 1),
  '%d': pad2(fixed.getUTCDate()), '%b': MONTHS[fixed.getUTCMonth()].slice(0, 3),
  '%B': MONTHS[fixed.getUTCMonth()], '%H': '00', '%M': '00', '%%': '%' })[code]);

const template = new Template(source);
const conversations = JSON.parse(readFileSync(conversationsPath, 'utf8'));
const out = conversations.map((messages) => {
  try {
    return { text: template.render({
      messages, bos_token: tokenText(config.bos_token), eos_token: tokenText(config.eos_token),
      add_generation_prompt, strftime_now: strftimeNow, ...extra }) };
  } catch (error) {
    return { error: String(error?.message ?? error) };
  }
});
process.stdout.write(JSON.stringify(out));
