// A unit-conversion agent written the ordinary Vercel AI SDK way: generateText with one tool and
// several steps (the model calls `convert`, reads the result, and may call it again before it answers).
//
// It knows nothing of tracerl. The model is any OpenAI-compatible chat server at OPENAI_BASE_URL
// (@ai-sdk/openai reads it, and OPENAI_API_KEY); tracing is instrumentation.mjs's job.
//
// Task (JSON on stdin, or as the first argument, or in $TRACERL_TASK): {"id": ..., "question": "..."}.
// Prints one JSON line: {"answer": <the last number of the final text, or null>, "final": <that text>,
// "steps": <model calls made>}.
import { openai } from "@ai-sdk/openai";
import { generateText, stepCountIs, tool } from "ai";
import { z } from "zod";

const MODEL = process.env.UNITS_MODEL ?? "policy";
const MAX_STEPS = Number(process.env.UNITS_MAX_STEPS ?? "4");
const MAX_TOKENS = Number(process.env.UNITS_MAX_TOKENS ?? "256");
const TEMPERATURE = Number(process.env.UNITS_TEMPERATURE ?? "1.0");

const SYSTEM =
  "You convert quantities between units. Use the convert tool for every conversion; never convert " +
  "in your head. Then answer with one short sentence that ends with the final number, e.g. " +
  "'That is 26.22 miles.'";

// Factors to each dimension's base unit (metre, kilogram, litre, second).
const UNITS = {
  m: ["length", 1], km: ["length", 1000], cm: ["length", 0.01], mi: ["length", 1609.344],
  ft: ["length", 0.3048], in: ["length", 0.0254],
  kg: ["mass", 1], g: ["mass", 0.001], lb: ["mass", 0.45359237], oz: ["mass", 0.028349523125],
  l: ["volume", 1], ml: ["volume", 0.001], gal: ["volume", 3.785411784],
  s: ["time", 1], min: ["time", 60], h: ["time", 3600],
};

/** `value` in unit `from`, expressed in unit `to`, rounded to 4 significant decimals. */
export function convert({ value, from, to }) {
  const [a, b] = [UNITS[from], UNITS[to]];
  if (!a || !b) throw new Error(`unknown unit ${!a ? from : to}; known: ${Object.keys(UNITS).join(", ")}`);
  if (a[0] !== b[0]) throw new Error(`cannot convert ${a[0]} (${from}) to ${b[0]} (${to})`);
  return Number(((value * a[1]) / b[1]).toFixed(4));
}

const tools = {
  convert: tool({
    description: "Convert a quantity from one unit to another.",
    inputSchema: z.object({
      value: z.number().describe("the quantity"),
      from: z.enum(Object.keys(UNITS)).describe("its unit"),
      to: z.enum(Object.keys(UNITS)).describe("the unit wanted"),
    }),
    execute: async (input) => String(convert(input)),
  }),
};

async function readTask() {
  if (process.argv[2]) return JSON.parse(process.argv[2]);
  if (process.env.TRACERL_TASK) return JSON.parse(process.env.TRACERL_TASK);
  let text = "";
  for await (const chunk of process.stdin) text += chunk;
  return JSON.parse(text);
}

async function main() {
  const task = await readTask();
  const result = await generateText({
    model: openai.chat(MODEL),
    system: SYSTEM,
    prompt: task.question,
    tools,
    stopWhen: stepCountIs(MAX_STEPS),
    maxOutputTokens: MAX_TOKENS,
    temperature: TEMPERATURE,
    telemetry: { functionId: "units" },
  });
  const numbers = result.text.match(/-?\d[\d,]*(?:\.\d+)?/g) ?? [];
  const answer = numbers.length ? Number(numbers.at(-1).replaceAll(",", "")) : null;
  console.log(JSON.stringify({ answer, final: result.text, steps: result.steps.length }));
}

if (import.meta.url === `file://${process.argv[1]}`) await main();
