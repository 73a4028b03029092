// The npm `ollama` client against a tokenmill host: list, create from Modelfile fields, two
// models chatted with alternately, ps, keep_alive 0 unloading, delete. Prints what it saw as
// one JSON object.
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

await client.create({ model: "mario-js", from: "alpha", system: "You are Mario." });
const listed = (await client.list()).models.map((m) => m.name);
const created = (await client.show({ model: "mario-js" })).modelfile;
const replies = [await ask("alpha"), await ask("beta"), await ask("alpha"), await ask("beta")];
const loaded = (await client.ps()).models.map((m) => m.name).sort();
await client.generate({ model: "alpha", prompt: "", keep_alive: 0 });
const after = (await client.ps()).models.map((m) => m.name).sort();
await client.delete({ model: "mario-js" });
const remaining = (await client.list()).models.map((m) => m.name);
let missing = null;
try {
  await ask("nope");
} catch (e) {
  missing = e.status_code ?? e.status ?? String(e);
}
console.log(JSON.stringify({ listed, created, replies, loaded, after, remaining, missing }));
