// A tiny agent traced with the stock OpenTelemetry JS SDK, exporting OTLP/HTTP JSON (the JS exporter's
// default encoding) to the URL given as the first argument. It prints the ids of what it made as JSON.
const { TracerProvider, SimpleSpanProcessor } = require("@opentelemetry/sdk-trace");
const { OTLPTraceExporter } = require("@opentelemetry/exporter-trace-otlp-http");
const { resourceFromAttributes } = require("@opentelemetry/resources");
const api = require("@opentelemetry/api");

async function main() {
  const url = process.argv[2];
  const exporter = new OTLPTraceExporter({ url });
  const provider = new TracerProvider({
    resource: resourceFromAttributes({ "service.name": "js-agent" }),
    spanProcessors: [new SimpleSpanProcessor({ exporter })],
  });
  const tracer = provider.getTracer("fulmen-test-js", "1.0.0");
  const root = tracer.startSpan("invoke_agent planner", {
    attributes: { "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "planner", "fulmen.rollout.id": "js-rollout" },
  });
  const ctx = api.trace.setSpan(api.context.active(), root);
  const chat = tracer.startSpan("chat tiny", {
    kind: api.SpanKind.CLIENT,
    attributes: {
      "gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny", "gen_ai.usage.input_tokens": 3,
      "fulmen.llm.prompt_token_ids": [11, 12, 13], "fulmen.llm.response_token_ids": [14, 15],
      "fulmen.llm.response_logprobs": [-0.5, -1.25], "fulmen.rollout.id": "js-rollout", "fulmen.rollout.attempt": 2,
    },
  }, ctx);
  chat.addEvent("gen_ai.content.prompt", { "gen_ai.prompt": "2+2?" });
  chat.end();
  root.setStatus({ code: api.SpanStatusCode.ERROR, message: "tool failed" });
  root.end();
  await provider.forceFlush();
  await provider.shutdown();
  console.log(JSON.stringify({ trace_id: root.spanContext().traceId, root: root.spanContext().spanId, chat: chat.spanContext().spanId }));
}

main().catch((err) => { console.error(err); process.exit(1); });
