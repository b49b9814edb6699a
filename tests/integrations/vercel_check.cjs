// Checks UI message streams with the Vercel AI SDK's own code (tests/integrations/test_vercel.py).
//
//   node vercel_check.cjs <dir holding node_modules/ai> <streams.json>
//
// streams.json: {"name": "<the framed stream: data: {...}\n\n ... data: [DONE]\n\n>", ...}.
// For each stream, prints (as one JSON object on stdout, by name):
//   framing:  what is wrong with its SSE framing (every event a `data:` line, [DONE] last)
//   invalid:  each part the protocol's schema (`uiMessageChunkSchema`) refuses, with why
//   errors:   what `readUIMessageStream` (the client's reader, as useChat runs it) reported
//   message:  the UI message it built (its parts), for the test to compare
"use strict";
const { createRequire } = require("node:module");
const fs = require("node:fs");
const path = require("node:path");

const requireAi = createRequire(path.join(path.resolve(process.argv[2]), "package.json"));
const ai = requireAi("ai");
const streams = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));

function frames(text) {
  const problems = [];
  const events = text.split("\n\n");
  if (events.pop() !== "") problems.push("the stream does not end with a blank line");
  const parts = [];
  let done = false;
  for (const event of events) {
    if (!event.startsWith("data: ") || event.includes("\n")) {
      problems.push(`not one data line: ${JSON.stringify(event).slice(0, 80)}`);
      continue;
    }
    const data = event.slice(6);
    if (done) problems.push("an event after [DONE]");
    if (data === "[DONE]") {
      done = true;
      continue;
    }
    parts.push(JSON.parse(data));
  }
  if (!done) problems.push("no data: [DONE] at the end");
  return { problems, parts };
}

async function check(text) {
  const { problems, parts } = frames(text);
  const schema = ai.uiMessageChunkSchema();
  const invalid = [];
  for (const [index, part] of parts.entries()) {
    const result = await schema.validate(part);
    if (!result.success) invalid.push({ index, type: part.type, error: String(result.error) });
  }
  const errors = [];
  const stream = new ReadableStream({
    start(controller) {
      for (const part of parts) controller.enqueue(part);
      controller.close();
    },
  });
  let message = null;
  try {
    for await (const snapshot of ai.readUIMessageStream({
      stream,
      onError: (error) => errors.push({ name: error.name, message: error.message }),
    })) {
      message = snapshot;
    }
  } catch (error) {
    errors.push({ name: error.name, message: error.message });
  }
  return { framing: problems, invalid, errors, message };
}

(async () => {
  const out = {};
  for (const [name, text] of Object.entries(streams)) out[name] = await check(text);
  process.stdout.write(JSON.stringify(out));
})().catch((error) => {
  process.stderr.write(String(error && error.stack ? error.stack : error));
  process.exit(1);
});
