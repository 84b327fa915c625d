// Prints the reference token ids of a Hugging Face tokenizer for a list of strings.
//
//   node reference.mjs NPM_DIR MODEL_DIR STRINGS_JSON
// NPM_DIR holds node_modules/@huggingface/transformers (setup.sh); MODEL_DIR holds
// tokenizer.json and tokenizer_config.json; STRINGS_JSON is a JSON array of strings.
// Output (stdout): a JSON array, one {"ids": [...], "decoded": "..."} per string, where
// ids come from encode(text, {add_special_tokens: false}) and decoded is
// decode(ids, {skip_special_tokens: false, clean_up_tokenization_spaces: false}).
// The tokenizer is built from the files alone: nothing is fetched.
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const [npmDir, modelDir, stringsPath] = process.argv.slice(2);
if (!stringsPath) {
  console.error('usage: node reference.mjs NPM_DIR MODEL_DIR STRINGS_JSON');
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(npmDir), 'package.json'));
const entry = require.resolve('@huggingface/transformers');
const { PreTrainedTokenizer } = await import(pathToFileURL(entry).href);

const readJson = (name) => JSON.parse(readFileSync(path.join(modelDir, name), 'utf8'));
const tokenizer = new PreTrainedTokenizer(readJson('tokenizer.json'),
                                          readJson('tokenizer_config.json'));
const strings = JSON.parse(readFileSync(stringsPath, 'utf8'));
const out = strings.map((text) => {
  const ids = tokenizer.encode(text, { add_special_tokens: false });
  const decoded = ids.length === 0 ? '' : tokenizer.decode(ids, {
    skip_special_tokens: false, clean_up_tokenization_spaces: false });
  return { ids, decoded };
});
process.stdout.write(JSON.stringify(out));
