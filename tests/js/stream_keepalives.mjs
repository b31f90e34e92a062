// Streams one Chat Completions request through the openai node SDK and through the AI SDK's
// OpenAI-compatible provider (what opencode uses); prints what each parsed, as JSON.
// usage: node stream_keepalives.mjs NODE_MODULES_PARENT BASE_URL
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";

const [dir, base] = process.argv.slice(2);
const require = createRequire(dir + "/package.json");
const load = async (name) => import(pathToFileURL(require.resolve(name)).href);

const { default: OpenAI } = await load("openai");
const client = new OpenAI({ baseURL: base + "/v1", apiKey: "x", maxRetries: 0 });
const openai = { text: "", chunks: 0, errors: [] };
try {
  const stream = await client.chat.completions.create({
    model: "m", messages: [{ role: "user", content: "hello from node" }], stream: true,
  });
  for await (const chunk of stream) {
    openai.chunks += 1;
    openai.text += chunk.choices[0]?.delta?.content ?? "";
  }
} catch (e) { openai.errors.push(String(e)); }

const { streamText } = await load("ai");
const { createOpenAICompatible } = await load("@ai-sdk/openai-compatible");
const provider = createOpenAICompatible({ name: "edge0", baseURL: base + "/v1", apiKey: "x" });
const ai = { text: "", parts: 0, errors: [] };
try {
  const result = streamText({
    model: provider("m"), prompt: "hello from the ai sdk", maxRetries: 0,
    onError: ({ error }) => ai.errors.push(String(error)),
  });
  for await (const part of result.fullStream) {
    ai.parts += 1;
    if (part.type === "text-delta") ai.text += part.text ?? part.textDelta ?? "";
    if (part.type === "error") ai.errors.push(String(part.error));
  }
} catch (e) { ai.errors.push(String(e)); }
console.log(JSON.stringify({ openai, ai }));
