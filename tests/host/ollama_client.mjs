// The npm `ollama` client against a tokenmill host: list, two models chatted with
// alternately, ps, and keep_alive 0 unloading. Prints what it saw as one JSON object.
// Usage: node ollama_client.mjs URL KEY (NODE_PATH: where `ollama` is installed).
import { createRequire } from "node:module";

const require = createRequire(process.env.NODE_PATH + "/");
const { Ollama } = require("ollama");
const [url, key] = process.argv.slice(2);
const client = new Ollama({ host: url, headers: { Authorization: `Bearer ${key}` } });
const options = { num_predict: 4, temperature: 0 };
const ask = async (model) =>
  (await client.chat({ model, messages: [{ role: "user", content: "hi" }], options }))
    .message.content;

const listed = (await client.list()).models.map((m) => m.name);
const replies = [await ask("alpha"), await ask("beta"), await ask("alpha"), await ask("beta")];
const loaded = (await client.ps()).models.map((m) => m.name).sort();
await client.generate({ model: "alpha", prompt: "", keep_alive: 0 });
const after = (await client.ps()).models.map((m) => m.name).sort();
let missing = null;
try {
  await ask("nope");
} catch (e) {
  missing = e.status_code ?? e.status ?? String(e);
}
console.log(JSON.stringify({ listed, replies, loaded, after, missing }));
