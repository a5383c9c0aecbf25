"use strict";
// The page of `ringctx serve`. Every call is the server's public API, the same any client uses:
// /v1/documents (ingest, watch, list, delete), /v1/chat/completions (streamed answers), /v1/models
// and /health. Everything shown that came from the server or the user is set as text (textContent,
// text nodes): never parsed as HTML, so a document named "<script>..." is shown as those characters.

const KEY_STORAGE = "ringctx.apiKey"; // sessionStorage: the key lives as long as this browser tab
const POLL_BUSY_MS = 500;             // while a document is ingesting
const POLL_IDLE_MS = 3000;

const $ = (id) => document.getElementById(id);
const state = {
  model: null,          // the served model's id (GET /v1/models)
  watching: null,       // id of the document shown in the ingest view
  needKey: false,       // the server answered 401: wait for the user's key before calling it again
  answer: null,         // AbortController of the answer streaming in
  // The conversation: the document its first question was about ("" for none) and its turns, each a
  // question with its answer in full (a stopped or failed answer is not one). Every question sends
  // them all before it, so a follow-up continues the chat (and the server's prefix cache can reuse it).
  conversation: { document: "", turns: [] },
  offered: null,        // the watched document the question's menu has offered (chosen for the user once)
  rows: new Map(),      // document id -> its row in the documents table
  shownErrors: new Map(), // message -> its element (a repeated error is shown once)
};

// ------------------------------------------------------------------ errors
class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Show a message in the error area (once per distinct message), with a button to dismiss it. */
function showError(message) {
  if (state.shownErrors.has(message)) return;
  const item = document.createElement("div");
  item.className = "error";
  const text = document.createElement("span");
  text.textContent = message;
  const close = document.createElement("button");
  close.type = "button";
  close.textContent = "×";
  close.title = "dismiss";
  close.addEventListener("click", () => { item.remove(); state.shownErrors.delete(message); });
  item.append(text, close);
  $("errors").append(item);
  state.shownErrors.set(message, item);
}

function clearErrors() {
  for (const item of state.shownErrors.values()) item.remove();
  state.shownErrors.clear();
}

// A fault in this script is shown too: never a blank or silently stuck page.
window.addEventListener("error", (event) => showError(`page error: ${event.message}`));
window.addEventListener("unhandledrejection", (event) => showError(`page error: ${messageOf(event.reason)}`));

function messageOf(error) {
  return error && error.message ? error.message : String(error);
}

// ------------------------------------------------------------------ the API
/** fetch() of one API call with the API key if one was given; resolves to the Response when 2xx.
 *  Rejects with an ApiError carrying the server's OpenAI error message otherwise. */
async function api(method, path, body, signal) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  const init = { method, headers, signal };
  if (body instanceof FormData) {
    init.body = body;
  } else if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(`cannot reach the server (${messageOf(error)}): is ringctx serve still running?`, 0);
  }
  if (response.ok) return response;
  const error = await errorOf(response);
  if (response.status === 401) askForKey(error.message);
  throw error;
}

async function apiJson(method, path, body) {
  return (await api(method, path, body)).json();
}

/** The ApiError of a non-2xx response: the OpenAI error object's message, else the HTTP status. */
async function errorOf(response) {
  let message = `the server answered ${response.status} ${response.statusText}`;
  let code = null;
  try {
    const data = await response.json();
    if (data && data.error && data.error.message) {
      message = data.error.message;
      code = data.error.code;
    }
  } catch (_) { /* not JSON: keep the status line */ }
  return new ApiError(message, response.status, code);
}

// ------------------------------------------------------------------ the API key
/** The server wants a key (401): ask for it once, and stop calling the server until it is given. */
function askForKey(reason) {
  const refused = sessionStorage.getItem(KEY_STORAGE) !== null;
  if (refused) {  // the key given was refused: say so, and ask again
    sessionStorage.removeItem(KEY_STORAGE);
    showError(`the server refused the API key: ${reason}`);
  }
  state.needKey = true;
  $("key-reason").textContent = refused ? "" : reason;
  $("key-form").hidden = false;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("key-input").value = "";
  $("key-form").hidden = true;
  state.needKey = false;
  clearErrors();
  start();
});

// ------------------------------------------------------------------ formatting
function fmtInt(n) {
  return Number(n).toLocaleString("en-US");
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i === 0 ? n : n.toFixed(n < 10 ? 2 : 1)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
  const two = (x) => String(x).padStart(2, "0");
  return h ? `${h}:${two(m)}:${two(sec)}` : `${m}:${two(sec)}`;
}

const STATUS_TEXT = { ready: "ready", on_disk: "on disk", ingesting: "ingesting", failed: "failed" };

function statusText(doc) {
  if (doc.status === "ingesting") return `ingesting ${doc.chunks.done}/${doc.chunks.total}`;
  return STATUS_TEXT[doc.status] || doc.status;
}

function sum(values) {
  return values.reduce((a, b) => a + b, 0);
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.append(td);
  return td;
}

// ------------------------------------------------------------------ ingest
$("ingest-button").addEventListener("click", async () => {
  const text = $("doc-text").value;
  if (!text.trim()) { showError("paste some text (or drop a .txt or .md file) before ingesting"); return; }
  await ingest({ text, name: $("doc-name").value.trim() || "pasted text" });
  $("doc-text").value = "";
});

$("file").addEventListener("change", async (event) => {
  const file = event.target.files[0];
  event.target.value = "";
  if (file) await ingestFile(file);
});

const drop = $("drop");
drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", async (event) => {
  event.preventDefault();
  drop.classList.remove("over");
  const file = event.dataTransfer.files[0];
  if (file) await ingestFile(file);
  else if (event.dataTransfer.getData("text")) $("doc-text").value = event.dataTransfer.getData("text");
});
// A file dropped next to the zone must not make the browser leave the page to show it.
window.addEventListener("dragover", (event) => event.preventDefault());
window.addEventListener("drop", (event) => event.preventDefault());

async function ingestFile(file) {
  if (!/\.(txt|md)$/i.test(file.name)) {
    showError(`${file.name} is not a .txt or .md file: give plain text`);
    return;
  }
  const form = new FormData();
  form.append("file", file, file.name);
  await ingest(form);
}

/** POST /v1/documents (JSON {text, name} or a multipart file), then watch its ingest. */
async function ingest(body) {
  $("ingest-button").disabled = true;
  try {
    const doc = await apiJson("POST", "/v1/documents", body);
    watch(doc.id);
    renderProgress(doc);
    await refreshDocuments();
  } catch (error) {
    showError(`could not ingest: ${messageOf(error)}`);
  } finally {
    $("ingest-button").disabled = false;
  }
}

function watch(docId) {
  state.watching = docId;
  $("progress").hidden = false;
}

/** The ingest view of one document (GET /v1/documents/{id}). */
function renderProgress(doc) {
  $("p-name").textContent = doc.name;
  $("p-id").textContent = doc.id;
  const status = $("p-status");
  status.textContent = statusText(doc);
  status.dataset.status = doc.status;
  status.className = `status-${doc.status}`;
  const { done, total } = doc.chunks;
  $("p-chunks").textContent = `${done} of ${total}`;
  $("p-tokens").textContent = fmtInt(doc.tokens);
  $("p-time").textContent = fmtSeconds(doc.seconds);
  // The server's ETA counts work (each chunk attends to all before it), so the bar does too.
  const ingesting = doc.status === "ingesting";
  $("p-eta").textContent = ingesting ? (doc.eta_s === null ? "after the first chunk" : fmtSeconds(doc.eta_s)) : "—";
  const bar = $("p-bar");
  bar.value = !ingesting ? (doc.status === "failed" ? 0 : 1)
    : doc.eta_s !== null && doc.seconds + doc.eta_s > 0 ? doc.seconds / (doc.seconds + doc.eta_s) : done / total;
  $("p-rate").textContent = doc.tokens_per_s === null ? "—" : fmtInt(Math.round(doc.tokens_per_s));
  const kv = doc.kv;
  $("p-kv").textContent = kv.in_memory
    ? kv.bytes_per_rank.map((b, i) => `rank ${kv.decode_ranks[i] ?? i}: ${fmtBytes(b)}`).join(", ")
    : (ingesting ? "after the hand-off" : "not in memory");
  $("p-disk").textContent = kv.bytes_on_disk ? fmtBytes(kv.bytes_on_disk) : "—";
  const problem = $("p-error");
  problem.hidden = !doc.error;
  problem.textContent = doc.error || "";

  const body = $("p-chunk-table").querySelector("tbody");
  body.replaceChildren();
  doc.chunks.strategies.forEach((strategy, i) => {
    const row = document.createElement("tr");
    cell(row, String(i + 1), "num");
    cell(row, strategy);
    cell(row, doc.chunks.tokens && doc.chunks.tokens[i] !== undefined ? fmtInt(doc.chunks.tokens[i]) : "", "num");
    cell(row, doc.chunks.seconds[i] !== undefined ? doc.chunks.seconds[i].toFixed(2) : "", "num");
    body.append(row);
  });
}

// ------------------------------------------------------------------ the documents
/** GET /v1/documents into the table and the question's document menu (rows kept, cells updated). */
async function refreshDocuments() {
  const listed = await apiJson("GET", "/v1/documents");
  const seen = new Set();
  const table = $("doc-table").querySelector("tbody");
  for (const doc of listed.data) {
    seen.add(doc.id);
    let row = state.rows.get(doc.id);
    if (!row) {
      row = newDocumentRow(doc);
      state.rows.set(doc.id, row);
      table.append(row);
    }
    updateDocumentRow(row, doc);
  }
  for (const [id, row] of state.rows) {
    if (!seen.has(id)) { row.remove(); state.rows.delete(id); }
  }
  $("no-docs").hidden = listed.data.length > 0;
  updateDocumentMenu(listed.data);
  return listed.data;
}

function newDocumentRow(doc) {
  const row = document.createElement("tr");
  row.dataset.id = doc.id;
  for (const name of ["name", "status", "tokens num", "memory num", "disk num"]) cell(row, "", name);
  const actions = cell(row, "", "actions");
  const view = document.createElement("button");
  view.type = "button";
  view.className = "small";
  view.textContent = "view";
  view.addEventListener("click", async () => { watch(doc.id); await poll(); });
  const ask = document.createElement("button");
  ask.type = "button";
  ask.className = "small";
  ask.textContent = "ask";
  ask.addEventListener("click", () => { $("ask-doc").value = doc.id; documentChosen(); $("question").focus(); });
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "small danger";
  remove.textContent = "delete";
  remove.addEventListener("click", () => deleteDocument(doc.id, remove));
  actions.append(view, " ", ask, " ", remove);
  return row;
}

function updateDocumentRow(row, doc) {
  const cells = row.children;
  cells[0].textContent = doc.name;
  cells[0].title = doc.id;
  cells[1].textContent = statusText(doc);
  cells[1].className = `status-${doc.status}`;
  cells[1].title = doc.error || "";
  row.dataset.status = doc.status;
  cells[2].textContent = fmtInt(doc.tokens);
  cells[3].textContent = doc.kv.in_memory ? fmtBytes(sum(doc.kv.bytes_per_rank)) : "—";
  cells[4].textContent = doc.kv.bytes_on_disk ? fmtBytes(doc.kv.bytes_on_disk) : "—";
}

/** Delete asks for a second click within 4 s (it removes the document's KV cache from the store). */
async function deleteDocument(docId, button) {
  if (button.dataset.armed !== "yes") {
    button.dataset.armed = "yes";
    button.textContent = "sure?";
    setTimeout(() => { button.dataset.armed = ""; button.textContent = "delete"; }, 4000);
    return;
  }
  try {
    await api("DELETE", `/v1/documents/${encodeURIComponent(docId)}`);
    if (state.watching === docId) { state.watching = null; $("progress").hidden = true; }
    await refreshDocuments();
  } catch (error) {
    showError(`could not delete: ${messageOf(error)}`);
  }
}

/** The question's menu: documents that can be asked about (ready or on disk), the choice kept. A
 *  document ingested (or viewed) is chosen once it can be asked about, unless a conversation is
 *  going on; when the chosen document has gone, the conversation about it ends. */
function updateDocumentMenu(docs) {
  const menu = $("ask-doc");
  const chosen = menu.value;
  const askable = docs.filter((d) => d.status === "ready" || d.status === "on_disk");
  const options = [new Option("no document", "")];
  for (const doc of askable) options.push(new Option(`${doc.name} (${fmtInt(doc.tokens)} tokens)`, doc.id));
  const same = options.length === menu.options.length &&
    options.every((o, i) => o.value === menu.options[i].value && o.text === menu.options[i].text);
  if (!same) menu.replaceChildren(...options);  // Option(text, value) sets text, never HTML
  const watched = state.watching && askable.some((d) => d.id === state.watching) ? state.watching : "";
  if (chosen && askable.some((d) => d.id === chosen)) menu.value = chosen;
  else if (chosen) menu.value = watched;  // the chosen document has gone
  else if (watched && watched !== state.offered && !conversationGoingOn()) menu.value = watched;
  else menu.value = "";
  if (watched) state.offered = watched;  // offered once: "no document" chosen after it stays chosen
  documentChosen();
}

// ------------------------------------------------------------------ questions
$("ask-button").addEventListener("click", () => ask());
$("stop-button").addEventListener("click", () => { if (state.answer) state.answer.abort(); });
$("new-conversation").addEventListener("click", () => { newConversation(); $("question").focus(); });
$("ask-doc").addEventListener("change", () => documentChosen());

function conversationGoingOn() {
  return state.conversation.turns.length > 0 || state.answer !== null;
}

/** The question's menu may have changed: another document starts a new conversation. */
function documentChosen() {
  if ($("ask-doc").value !== state.conversation.document) newConversation();
}

/** An empty conversation about the document chosen in the menu; an answer streaming in is stopped. */
function newConversation() {
  if (state.answer) state.answer.abort();
  state.conversation = { document: $("ask-doc").value, turns: [] };
  $("turns").replaceChildren();
  updateNewConversationButton();
}

function updateNewConversationButton() {
  $("new-conversation").disabled = $("turns").children.length === 0;
}

/** A turn's element in the list, newest last: the question, its answer, its stats line. The newest
 *  turn's answer and stats line are #answer and #answer-stats (the ids move on to the next turn). */
function newTurn(question) {
  for (const id of ["answer", "answer-stats"]) {
    const previous = $(id);
    if (previous) previous.removeAttribute("id");
  }
  const item = document.createElement("li");
  item.className = "turn";
  const asked = document.createElement("p");
  asked.className = "question";
  asked.textContent = question;
  const answer = document.createElement("div");
  answer.className = "answer";
  answer.id = "answer";
  const stats = document.createElement("p");
  stats.className = "answer-stats muted";
  stats.id = "answer-stats";
  item.append(asked, answer, stats);
  $("turns").append(item);
  updateNewConversationButton();
  return { item, answer, stats };
}

/** POST /v1/chat/completions with stream: true, the conversation's turns before the question; the
 *  answer's text streams into a new turn, added to the conversation once it has ended in full. */
async function ask() {
  const question = $("question").value.trim();
  if (!question) { showError("type a question first"); return; }
  const maxTokens = parseInt($("max-tokens").value, 10);
  documentChosen();
  const conversation = state.conversation;
  for (const dropped of $("turns").querySelectorAll(".turn.dropped")) dropped.remove();  // asked again, or not
  const messages = [];
  for (const turn of conversation.turns) {
    messages.push({ role: "user", content: turn.question }, { role: "assistant", content: turn.answer });
  }
  messages.push({ role: "user", content: question });
  const { item, answer, stats } = newTurn(question);
  answer.dataset.state = "waiting";
  stats.textContent = "waiting for the first token…";
  $("ask-button").disabled = true;
  $("stop-button").disabled = false;
  const controller = new AbortController();
  state.answer = controller;
  const clock = { sent: performance.now(), first: null, last: null, pieces: 0, usage: null, finish: null };
  let text = "";
  try {
    if (!state.model) await loadModel();
    const body = {
      model: state.model, messages, stream: true, stream_options: { include_usage: true }, temperature: 0,
    };
    if (maxTokens > 0) body.max_tokens = maxTokens;
    // ringctx's extra field: the document's KV cache is the prefix (the same for every turn)
    if (conversation.document) body.document = conversation.document;
    const response = await api("POST", "/v1/chat/completions", body, controller.signal);
    answer.dataset.state = "streaming";
    for await (const event of serverSentEvents(response)) {
      if (event.error) throw new ApiError(event.error.message, 200, event.error.code);
      if (event.usage) clock.usage = event.usage;
      for (const choice of event.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          clock.last = performance.now();
          if (clock.first === null) clock.first = clock.last;
          clock.pieces++;
          text += piece;
          answer.append(piece);  // a text node: markup in the answer is shown as text
          stats.textContent = answerStats(clock);
        }
        if (choice.finish_reason) clock.finish = choice.finish_reason;
      }
    }
    answer.dataset.state = "done";
    stats.textContent = answerStats(clock);
    if (state.conversation === conversation) conversation.turns.push({ question, answer: text });
    if ($("question").value.trim() === question) $("question").value = "";
  } catch (error) {
    item.classList.add("dropped");  // not part of the conversation: the question can be asked again
    if (error.name === "AbortError") {
      answer.dataset.state = "stopped";
      stats.textContent = `${answerStats(clock)} (stopped; not kept in the conversation)`;
    } else {
      answer.dataset.state = "error";
      stats.textContent = "not kept in the conversation";
      showError(`could not answer: ${messageOf(error)}`);
    }
  } finally {
    if (state.answer === controller) {
      state.answer = null;
      $("ask-button").disabled = false;
      $("stop-button").disabled = true;
    }
  }
}

/** "first token after 0.41 s · 16 tokens · 23.5 tokens/s · 1,620 prompt tokens from the cache". */
function answerStats(clock) {
  if (clock.first === null) return clock.finish ? "no tokens" : "waiting for the first token…";
  const tokens = clock.usage ? clock.usage.completion_tokens : clock.pieces;
  const parts = [`first token after ${((clock.first - clock.sent) / 1000).toFixed(2)} s`, `${fmtInt(tokens)} tokens`];
  // The decode rate: tokens after the first over the time they took (the first one's is the TTFT).
  const seconds = (clock.last - clock.first) / 1000;
  if (clock.pieces > 1 && seconds > 0) parts.push(`${((clock.pieces - 1) / seconds).toFixed(1)} tokens/s`);
  const cached = clock.usage && clock.usage.prompt_tokens_details && clock.usage.prompt_tokens_details.cached_tokens;
  if (cached) parts.push(`${fmtInt(cached)} prompt tokens from the cache`);
  if (clock.finish === "length") parts.push("stopped at max tokens");
  return parts.join(" · ");
}

/** The JSON objects of a text/event-stream body, read as it arrives, up to "data: [DONE]". */
async function* serverSentEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function loadModel() {
  const models = await apiJson("GET", "/v1/models");
  state.model = models.data[0].id;
  $("model").textContent = `model: ${state.model}`;
}

// ------------------------------------------------------------------ polling
async function health() {
  try {
    const response = await fetch("/health");
    const body = await response.json();
    $("health").textContent = body.status === "ok" ? `${body.ranks} rank(s) up` : `unavailable: ${body.problem}`;
    $("health").className = body.status === "ok" ? "muted" : "error-text";
  } catch (error) {
    $("health").textContent = "the server does not answer";
    $("health").className = "error-text";
  }
}

/** One refresh of the documents and of the watched ingest; the delay to the next follows its state. */
async function poll() {
  if (state.needKey) return POLL_IDLE_MS;
  const docs = await refreshDocuments();
  let busy = docs.some((d) => d.status === "ingesting");
  if (state.watching) {
    try {
      const doc = await apiJson("GET", `/v1/documents/${encodeURIComponent(state.watching)}`);
      renderProgress(doc);
    } catch (error) {
      if (error.status === 404) { state.watching = null; $("progress").hidden = true; } else throw error;
    }
  }
  return busy ? POLL_BUSY_MS : POLL_IDLE_MS;
}

let timer = null;

async function loop() {
  let delay = POLL_IDLE_MS;
  try {
    delay = await poll();
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 401)) showError(messageOf(error));
  }
  clearTimeout(timer);
  timer = setTimeout(loop, delay);
}

/** First load, and again once an API key is given. */
async function start() {
  try {
    await loadModel();
  } catch (error) {
    if (error.status !== 401) showError(messageOf(error));  // a 401 has asked for the key
  }
  await loop();
}

health();
setInterval(health, 10000);
start();
