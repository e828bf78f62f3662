// Fulmen's dashboard: draws each page from the JSON under /api and polls it every data-poll-ms.
// Every value from the store is set as text (textContent), never as HTML.
"use strict";

const POLL_MS = Number(document.body.dataset.pollMs) || 3000;
const main = document.getElementById("main");
const statusLine = document.getElementById("status");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

async function api(path, params) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params || {})) {
    if (value !== "" && value !== undefined && value !== null) query.set(key, value);
  }
  const answer = await fetch(`/api/${path}?${query}`);
  const body = await answer.json();
  if (!answer.ok) throw new Error(body.error || `HTTP ${answer.status}`);
  return body;
}

function setStatus(text, bad) {
  statusLine.textContent = text;
  statusLine.classList.toggle("bad", Boolean(bad));
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(digits ?? 3);
  return String(value);
}

function when(iso) {
  return iso ? iso.replace("T", " ").replace(/\.\d+/, "").replace("+00:00", " UTC") : "–";
}

// A rollout's version is what served its LLM calls (as its spans and transitions say); its row's own
// ModelVersion is the version it was dispatched under, often none.
function versionTitle(r) {
  const dispatched = r.ModelVersion === null ? "none named" : String(r.ModelVersion);
  return `served its calls: ${r.Version}; dispatched under: ${dispatched}`;
}

function table(id, columns, rows, rowAttrs) {
  const head = el("tr", {}, ...columns.map(([label]) => el("th", { text: label })));
  const body = el("tbody");
  for (const row of rows) {
    const cells = columns.map(([, value]) => {
      const shown = value(row);
      return el("td", {}, shown instanceof Node ? shown : fmt(shown));
    });
    body.append(el("tr", rowAttrs ? rowAttrs(row) : {}, ...cells));
  }
  return el("table", { id }, el("thead", {}, head), body);
}

// Run fn now and every POLL_MS; errors are shown in the status line and polling goes on.
function poll(fn) {
  let timer = null;
  const tick = async () => {
    try {
      await fn();
      setStatus(`updated ${new Date().toLocaleTimeString()}`);
    } catch (error) {
      setStatus(`error: ${error.message}`, true);
    }
    timer = setTimeout(tick, POLL_MS);
  };
  tick();
  return () => clearTimeout(timer);
}

// --- runs and their steps ------------------------------------------------------------------------------
const CHARTS = [
  ["Reward", [["RewardMean", "training reward", "#2563eb"], ["HeldOut", "held-out accuracy", "#16a34a"]]],
  ["Loss", [["Loss", "loss", "#dc2626"]]],
  ["KL", [["Kl", "KL", "#9333ea"]]],
  ["Clip fraction", [["ClipFraction", "clip fraction", "#ea580c"]]],
  ["Tokens/s", [["TokensPerS", "tokens/s", "#0891b2"]]],
];

function stepChart(title, series, target) {
  const width = Math.max(320, Math.min(560, target.clientWidth || 560));
  const options = {
    title, width, height: 220,
    scales: { x: { time: false } },
    axes: [{ label: "step" }, {}],
    series: [{ label: "step" }, ...series.map(([, label, stroke]) => ({ label, stroke, width: 2, points: { show: true } }))],
  };
  const box = el("div", { class: "chart", "data-chart": title });
  target.append(box);
  return new uPlot(options, [[], ...series.map(() => [])], box);
}

function runsPage() {
  const params = new URLSearchParams(location.search);
  const runsBox = el("section", { id: "runs" }, el("h2", { text: "Runs" }));
  const detail = el("section", { id: "run-detail" });
  main.append(runsBox, detail);
  let chosen = params.get("run");
  let steps = [];
  let charts = [];
  let shownRun = null;

  const drawDetail = (versions) => {
    if (shownRun !== chosen) {
      detail.replaceChildren(el("h2", { text: `Run ${chosen}` }), el("p", { id: "steps-summary" }));
      const grid = el("div", { class: "charts" });
      detail.append(grid, el("h3", { text: "Model versions" }), el("div", { id: "versions" }));
      charts = CHARTS.map(([title, series]) => ({ series, chart: stepChart(title, series, grid) }));
      shownRun = chosen;
    }
    const xs = steps.map((s) => s.Step);
    for (const { series, chart } of charts) chart.setData([xs, ...series.map(([key]) => steps.map((s) => s[key]))]);
    const last = steps[steps.length - 1];
    document.getElementById("steps-summary").textContent = last
      ? `${steps.length} step(s); last: step ${last.Step}, version ${last.ModelVersion}, reward ${fmt(last.RewardMean)}, ` +
        `held-out ${fmt(last.HeldOut)}, loss ${fmt(last.Loss, 4)}`
      : "no steps yet";
    document.getElementById("versions").replaceChildren(table("versions-table", [
      ["version", (v) => v.Version], ["step", (v) => v.Step], ["model", (v) => v.ModelName],
      ["format", (v) => v.Format], ["published", (v) => when(v.CreatedAt)], ["where", (v) => v.Uri],
    ], versions));
  };

  poll(async () => {
    const runs = await api("runs");
    if (!chosen && runs.length) chosen = runs[0].RunId;
    runsBox.replaceChildren(el("h2", { text: "Runs" }), runs.length ? table("runs-table", [
      ["run", (r) => el("a", { href: `/?run=${encodeURIComponent(r.RunId)}`, text: r.RunId })],
      ["steps", (r) => r.Steps], ["last step", (r) => r.LastStep], ["version", (r) => r.LastVersion],
      ["reward", (r) => r.LastReward], ["started", (r) => when(r.StartedAt)], ["last step at", (r) => when(r.LastAt)],
      ["rollouts", (r) => el("a", { href: `/rollouts?run=${encodeURIComponent(r.RunId)}`, text: "rollouts" })],
    ], runs, (r) => ({ "data-run": r.RunId, class: r.RunId === chosen ? "chosen" : null }))
      : el("p", { class: "empty", text: "No training steps in the store yet." }));
    if (!chosen) return;
    if (shownRun !== chosen) steps = [];
    const after = steps.length ? steps[steps.length - 1].Step : "";
    const answer = await api("steps", { run: chosen, after });
    steps = steps.concat(answer.steps);
    drawDetail(answer.versions);
  });
}

// --- rollouts ------------------------------------------------------------------------------------------
const STATUSES = ["", "queued", "claimed", "running", "succeeded", "failed", "timed_out"];
const MODES = ["", "train", "val", "production"];

function rolloutsPage() {
  const params = new URLSearchParams(location.search);
  const filters = Object.fromEntries(["status", "mode", "run", "attempt", "offset"].map((k) => [k, params.get(k) || ""]));
  const select = (name, values) => el("select", { name, id: `filter-${name}` },
    ...values.map((v) => el("option", { value: v, text: v || "any", ...(v === filters[name] ? { selected: "" } : {}) })));
  const form = el("form", { id: "filters", method: "get", action: "/rollouts" },
    el("label", {}, "status ", select("status", STATUSES)),
    el("label", {}, "mode ", select("mode", MODES)),
    el("label", {}, "run ", el("input", { name: "run", id: "filter-run", value: filters.run, size: 28 })),
    el("label", {}, "attempt ", el("input", { name: "attempt", id: "filter-attempt", type: "number", min: 0, max: 100, value: filters.attempt })),
    el("button", { type: "submit", text: "filter" }));
  const summary = el("p", { id: "rollouts-summary" });
  const list = el("div", { id: "rollouts" });
  const pager = el("p", { class: "pager" });
  main.append(el("h2", { text: "Rollouts" }), form, summary, list, pager);

  poll(async () => {
    const answer = await api("rollouts", { ...filters, limit: 50 });
    const counts = Object.entries(answer.counts).map(([status, n]) => `${status} ${n}`).join(", ");
    summary.replaceChildren(el("span", { id: "rollouts-total", text: String(answer.total) }), ` rollout attempt(s)${counts ? ": " + counts : ""}`);
    list.replaceChildren(table("rollouts-table", [
      ["rollout", (r) => el("a", { href: `/rollout?id=${encodeURIComponent(r.RolloutId)}&attempt=${r.Attempt}`, text: r.RolloutId })],
      ["attempt", (r) => r.Attempt], ["status", (r) => el("span", { class: `badge ${r.Status}`, text: r.Status })],
      ["mode", (r) => r.Mode], ["reward", (r) => r.Reward], ["version", (r) => el("span", { title: versionTitle(r), text: r.Version })],
      ["task", (r) => r.TaskId], ["group", (r) => r.GroupId], ["runner", (r) => r.RunnerId],
      ["last change", (r) => when(r.Timestamp)], ["error", (r) => r.Error || ""],
    ], answer.rollouts, (r) => ({ "data-rollout": r.RolloutId, "data-attempt": r.Attempt, "data-status": r.Status })));
    const offset = Number(filters.offset) || 0;
    const link = (label, to) => el("a", { href: `/rollouts?${new URLSearchParams({ ...filters, offset: to })}`, text: label });
    pager.replaceChildren(
      offset > 0 ? link("← newer", Math.max(0, offset - 50)) : "",
      ` ${answer.total ? offset + 1 : 0}–${offset + answer.rollouts.length} of ${answer.total} `,
      offset + 50 < answer.total ? link("older →", offset + 50) : "");
  });
}

// --- one rollout's trace -------------------------------------------------------------------------------
function messages(list) {
  if (list === null || list === undefined) return el("em", { text: "none recorded" });
  if (!Array.isArray(list)) return el("pre", { text: String(list) });
  return el("div", { class: "messages" }, ...list.map((m) => {
    let content = m.content;
    if (Array.isArray(content)) content = content.map((part) => part.text ?? part.content ?? JSON.stringify(part)).join("\n");
    const calls = m.tool_calls ? "\n" + JSON.stringify(m.tool_calls, null, 1) : "";
    return el("div", { class: `message ${m.role}` }, el("span", { class: "role", text: m.role || "?" }),
      el("pre", { text: `${content ?? ""}${calls}` }));
  }));
}

function spanDetail(span) {
  const facts = [
    ["span", span.SpanId], ["trace", span.TraceId], ["service", span.ServiceName], ["scope", span.ScopeName],
    ["agent", span.AgentName], ["status", `${span.StatusCode} ${span.StatusMessage || ""}`],
    ["start", when(span.Timestamp)], ["duration", `${fmt(span.DurationMs, 2)} ms`],
    ["model version", span.ModelVersion], ["prompt tokens", span.PromptTokens], ["response tokens", span.ResponseTokens],
    ["reward", span.Reward],
  ];
  const attributes = Object.entries(span.Attributes || {}).sort();
  return el("div", { class: "span-detail" },
    el("dl", {}, ...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: fmt(v) })])),
    span.InputMessages !== null || span.OutputMessages !== null
      ? el("div", { class: "llm-call" }, el("h4", { text: "prompt" }), messages(span.InputMessages),
        el("h4", { text: "response" }), messages(span.OutputMessages))
      : null,
    attributes.length ? el("details", {}, el("summary", { text: `${attributes.length} attribute(s)` }),
      table(null, [["key", (a) => a[0]], ["value", (a) => a[1]]], attributes)) : null);
}

function traceTree(spans) {
  const total = Math.max(1, ...spans.map((s) => s.OffsetMs + s.DurationMs));
  const rows = spans.map((span) => {
    const isCall = span.InputMessages !== null || span.ResponseTokens > 0;
    const bar = el("span", { class: `bar${isCall ? " call" : ""}`,
      style: `left:${(100 * span.OffsetMs / total).toFixed(2)}%;width:${Math.max(0.3, 100 * span.DurationMs / total).toFixed(2)}%` });
    const label = el("span", { class: "name", style: `padding-left:${span.Depth * 16}px` },
      isCall ? el("span", { class: "tag", text: "LLM" }) : null, span.SpanName,
      span.ModelVersion !== null ? el("span", { class: "muted", text: ` v${span.ModelVersion}` }) : null,
      isCall ? el("span", { class: "muted", text: ` ${span.PromptTokens}→${span.ResponseTokens} tok` }) : null,
      span.Reward !== null ? el("span", { class: "tag reward", text: `reward ${fmt(span.Reward)}` }) : null);
    const detail = el("div", { class: "span-detail-box", hidden: "" });
    const row = el("div", { class: "span-row", "data-span": span.SpanId, "data-llm": isCall ? "1" : "0" },
      el("div", { class: "span-line", onclick: () => {
        if (!detail.firstChild) detail.append(spanDetail(span));
        detail.hidden = !detail.hidden;
        row.classList.toggle("open", !detail.hidden);
      } }, label, el("span", { class: "timeline" }, bar), el("span", { class: "ms", text: `${fmt(span.DurationMs, 1)} ms` })),
      detail);
    return row;
  });
  return el("div", { id: "trace" }, ...rows);
}

function rolloutPage() {
  const params = new URLSearchParams(location.search);
  const state = { id: params.get("id") || "", attempt: params.get("attempt") || "", credit: params.get("credit") || "", gamma: params.get("gamma") || "" };
  const head = el("div", { id: "rollout-head" });
  const trace = el("section", {}, el("h3", { text: "Trace" }), el("div", { id: "trace-box" }));
  const calls = el("section", {}, el("h3", { text: "Transitions (one per trained LLM call)" }), el("div", { id: "credit-box" }), el("div", { id: "transitions" }));
  main.append(el("h2", { text: `Rollout ${state.id}` }), head, calls, trace);
  let shown = null;
  const creditForm = (credit) => el("form", { id: "credit-form", method: "get", action: "/rollout" },
    el("input", { type: "hidden", name: "id", value: state.id }), el("input", { type: "hidden", name: "attempt", value: state.attempt }),
    el("label", {}, "credit ", el("select", { name: "credit" }, ...credit.strategies.map((s) =>
      el("option", { value: s, text: s, ...(s === credit.strategy ? { selected: "" } : {}) })))),
    el("label", {}, " gamma ", el("input", { name: "gamma", value: credit.gamma, size: 4 })),
    el("button", { type: "submit", text: "apply" }));

  poll(async () => {
    const answer = await api("rollout", state);
    state.attempt = String(answer.attempt);
    head.replaceChildren(answer.attempts.length ? table("attempts-table", [
      ["attempt", (a) => a.Attempt === answer.attempt ? el("strong", { text: String(a.Attempt) })
        : el("a", { href: `/rollout?id=${encodeURIComponent(a.RolloutId)}&attempt=${a.Attempt}`, text: String(a.Attempt) })],
      ["status", (a) => el("span", { class: `badge ${a.Status}`, text: a.Status })], ["mode", (a) => a.Mode],
      ["reward", (a) => a.Reward], ["version", (a) => el("span", { title: versionTitle(a), text: a.Version })], ["task", (a) => a.TaskId],
      ["group", (a) => a.GroupId], ["runner", (a) => a.RunnerId], ["last change", (a) => when(a.Timestamp)],
      ["error", (a) => a.Error || ""],
    ], answer.attempts) : el("p", { class: "empty", text: "No lifecycle events for this rollout." }));
    document.getElementById("credit-box").replaceChildren(creditForm(answer.credit));
    document.getElementById("transitions").replaceChildren(answer.transitions.length ? table("transitions-table", [
      ["call", (t) => t.CallIndex], ["agent", (t) => t.AgentName], ["version", (t) => t.ModelVersion],
      ["prompt tokens", (t) => t.PromptTokens], ["response tokens", (t) => t.ResponseTokens],
      ["intermediate reward", (t) => t.IntermediateReward], ["episode reward", (t) => t.EpisodeReward],
      [`credited (${answer.credit.strategy})`, (t) => t.Credited], ["span", (t) => t.SpanId],
    ], answer.transitions, (t) => ({ "data-span": t.SpanId })) : el("p", { class: "empty", text: "No transitions (yet) for this attempt." }));
    const key = answer.spans.map((s) => s.SpanId).join(",");
    if (key !== shown) {  // redraw the tree only when spans arrived: open details stay open
      document.getElementById("trace-box").replaceChildren(answer.spans.length ? traceTree(answer.spans)
        : el("p", { class: "empty", text: "No spans stored for this attempt." }));
      shown = key;
    }
  });
}

// --- model versions -------------------------------------------------------------------------------------
function modelsPage() {
  const params = new URLSearchParams(location.search);
  const picker = el("p", { id: "model-picker" });
  const summary = el("p", { id: "models-summary" });
  const list = el("div", { id: "versions" });
  main.append(el("h2", { text: "Models" }), picker, summary, list);
  poll(async () => {
    const answer = await api("models", { model: params.get("model") || "" });
    picker.replaceChildren(...answer.models.flatMap((name) => [
      name === answer.model ? el("strong", { text: name }) : el("a", { href: `/models?model=${encodeURIComponent(name)}`, text: name }), " "]));
    const serving = answer.versions.find((v) => v.serving);
    summary.replaceChildren(serving
      ? el("span", { id: "serving", text: `Version ${serving.version} of run ${serving.run_id} serves the gateways that follow promotions.` })
      : el("span", { id: "serving", text: "Nothing promoted: gateways that follow promotions serve the model they started with." }));
    list.replaceChildren(answer.versions.length ? table("versions-table", [
      ["serves", (v) => (v.serving ? "★" : "")], ["version", (v) => v.version], ["run", (v) => v.run_id],
      ["parent", (v) => v.parent], ["held-out", (v) => fmt(v.score, 3)], ["decision", (v) => v.decision],
      ["gain vs serving (points)", (v) => v.test], ["checkpoint", (v) => el("code", { text: v.uri })],
    ], answer.versions.slice().reverse(), (v) => ({ "data-version": v.version, class: v.serving ? "serving" : "" }))
      : el("p", { class: "empty", text: "No version of this model is stored yet." }));
  });
}

// --- prompt bundles -----------------------------------------------------------------------------------
function scoreCell(b) {
  if (b.val_mean === null) return el("span", { class: "muted", text: "not scored" });
  const tasks = Object.entries(b.scores).map(([task, score]) => `${task}: ${fmt(score)}`).join("\n");
  return el("span", { title: tasks, text: `${fmt(b.val_mean)} (${b.val_tasks} val task(s))` });
}

function rolloutsCell(b) {
  const modes = Object.entries(b.rollouts);
  if (!modes.length) return "–";
  return el("div", {}, ...modes.map(([mode, r]) =>
    el("div", { "data-mode": mode, text: `${mode}: ${r.rollouts} rollout(s), mean reward ${fmt(r.mean)}` })));
}

function slotsCell(b) {
  return el("div", {}, ...Object.entries(b.slots).map(([slot, text]) =>
    el("div", { class: "slot", "data-slot": slot }, el("code", { text: slot }), el("pre", { text }))));
}

function promptsPage() {
  const params = new URLSearchParams(location.search);
  const run = params.get("run") || "";
  const picker = el("p", { id: "prompt-runs" });
  const summary = el("p", { id: "prompts-summary" });
  const list = el("div", { id: "bundles" });
  main.append(el("h2", { text: "Prompt bundles" }), picker, summary, list);
  poll(async () => {
    const answer = await api("prompts", { run });
    picker.replaceChildren("search run: ", run ? el("a", { href: "/prompts", text: "any" }) : el("strong", { text: "any" }),
      ...answer.runs.flatMap((r) => [" ", r === run ? el("strong", { text: r })
        : el("a", { href: `/prompts?run=${encodeURIComponent(r)}`, text: r })]));
    const serving = Object.entries(answer.serving).map(([scope, bundle]) =>
      `${bundle || "the agent's own prompts"} for ${scope || "every agent"}`);
    summary.replaceChildren(el("span", { id: "prompts-serving", text: serving.length
      ? `Serving calls that name no bundle: ${serving.join("; ")}.` : "No bundle promoted: agents' own prompts serve." }));
    list.replaceChildren(answer.bundles.length ? table("bundles-table", [
      ["serves", (b) => (b.serving.length ? `★ ${b.serving.map((s) => s || "every agent").join(", ")}` : "")],
      ["bundle", (b) => el("code", { class: "id", text: b.bundle_id })], ["agent", (b) => b.agent || "any"],
      ["source", (b) => b.source], ["run", (b) => b.run_id || "–"],
      ["parents", (b) => (b.parents.length ? el("div", {}, ...b.parents.map((p) => el("div", {}, el("code", { class: "id", text: p })))) : "–")], ["validation score", scoreCell],
      ["rollouts naming it", rolloutsCell], ["slots", slotsCell], ["created", (b) => when(b.created_at)],
    ], answer.bundles, (b) => ({ "data-bundle": b.bundle_id, class: b.serving.length ? "serving" : "" }))
      : el("p", { class: "empty", text: "No prompt bundle stored yet (fulmen prompts create, fulmen optimize-prompt)." }));
  });
}

// --- dead letters --------------------------------------------------------------------------------------
function deadPage() {
  const summary = el("p", { id: "dead-summary" });
  const list = el("div", { id: "dead" });
  main.append(el("h2", { text: "Dead letters" }), summary, list);
  poll(async () => {
    const answer = await api("dead-letters", { limit: 100 });
    summary.replaceChildren(el("span", { id: "dead-total", text: String(answer.total) }), " record(s) parked on the dead-letter topic (newest first).");
    list.replaceChildren(answer.records.length ? table("dead-table", [
      ["failed at", (d) => when(d.FailedAt)], ["from", (d) => `${d.SourceTopic}[${d.SourcePartition}]@${d.SourceOffset}`],
      ["consumer group", (d) => d.ConsumerGroup], ["error type", (d) => d.ErrorType], ["reason", (d) => d.Error],
      ["key", (d) => d.Key], ["bytes", (d) => d.ValueBytes], ["value (start)", (d) => el("code", { text: d.ValuePreview })],
    ], answer.records, (d) => ({ "data-offset": d.Offset })) : el("p", { class: "empty", text: "Nothing was dead-lettered." }));
  });
}

const PAGES = {
  runs: runsPage, rollouts: rolloutsPage, rollout: rolloutPage, models: modelsPage, prompts: promptsPage, dead: deadPage,
};
document.querySelector(`[data-nav="${document.body.dataset.page === "rollout" ? "rollouts" : document.body.dataset.page}"]`)?.classList.add("here");
PAGES[document.body.dataset.page]();
