// The chat page: conversations (stored on the server when it has a conversation store, else kept in
// this tab), a model picker, streamed answers rendered as markdown (a reasoning model's reasoning folded above),
// branches from regenerating and editing, stop, copy, per-answer token counts and latency, and images attached to
// a message (for a model that reads them: they go as data: URLs in OpenAI's image_url parts).

import { ApiError, apiKey, call, cancelStream, setApiKey, streamChat } from "./api.js";
import { copyButton, renderMarkdown } from "./markdown.js";

const $ = (selector) => document.querySelector(selector);
const ROOT = "";
const DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant.";

const state = {
  stored: true, // the server keeps conversations (/v1/conversations answers)
  conversations: [],
  current: null, // {id, title, model, local}
  nodes: new Map(), // message id -> {id, parent_id, role, content, token_count}
  children: new Map(), // parent id (ROOT for none) -> child ids, oldest first
  choice: new Map(), // which child (or which reply of a group of same-text user turns) is shown
  stats: new Map(), // message id -> {tokens, firstTokenMs, totalMs, asked, answeredBy}: this tab's answers
  pending: null, // the turn being streamed: {user, reply, streamId, controller}
  attachments: [], // data: URLs of the images to send with the next message
};

// A message's images (data: URLs): the server stores them with the turn.
function imagesOf(node) {
  return node.images ?? [];
}

// A message's content as the API takes it: its images as image_url parts before its text.
function content(text, images) {
  if (!images.length) return text;
  return [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }];
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  for (const file of files) state.attachments.push(await readAsDataURL(file));
  $("#image-file").value = "";
  renderAttachments();
}

function renderAttachments() {
  const strip = $("#attachments");
  strip.replaceChildren(...state.attachments.map((url, index) => {
    const item = document.createElement("span");
    item.className = "attachment";
    const remove = button("×", "Remove this image", () => { state.attachments.splice(index, 1); renderAttachments(); },
      "remove-image");
    item.append(thumbnail(url), remove);
    return item;
  }));
  strip.hidden = !state.attachments.length;
}

function thumbnail(url) {
  const image = document.createElement("img");
  image.className = "thumb";
  image.alt = "attached image";
  image.src = url;
  return image;
}

// ---- the tree of messages -------------------------------------------------------------------------

function loadTree(messages, headId) {
  state.nodes = new Map();
  state.children = new Map();
  state.choice = new Map();
  for (const message of foldReasoning(messages)) addNode(message);
  selectPathTo(headId);
}

// A reasoning model's turn is stored as its reasoning, then its answer: shown as one reply, the answer carrying
// its reasoning (`thought`). A reasoning followed by anything else (an API client's tool calls) stays a message.
function foldReasoning(messages) {
  const after = new Map(); // message id -> the messages stored after it
  for (const message of messages) {
    const key = message.parent_id ?? ROOT;
    if (!after.has(key)) after.set(key, []);
    after.get(key).push(message);
  }
  const reasoningOf = new Map(); // answer id -> its reasoning
  for (const message of messages) {
    const next = after.get(message.id) ?? [];
    if (message.reasoning && next.length === 1 && isAnswer(next[0])) reasoningOf.set(next[0].id, message);
  }
  const folded = new Set([...reasoningOf.values()].map((reasoning) => reasoning.id));
  return messages.filter((message) => !folded.has(message.id)).map((message) => {
    const reasoning = reasoningOf.get(message.id);
    return reasoning ? { ...message, parent_id: reasoning.parent_id, thought: reasoning.content } : message;
  });
}

function isAnswer(message) {
  return message.role === "assistant" && !message.reasoning && !message.tool_call;
}

function addNode(message) {
  state.nodes.set(message.id, message);
  const key = message.parent_id ?? ROOT;
  if (!state.children.has(key)) state.children.set(key, []);
  state.children.get(key).push(message.id);
}

function kids(key) {
  return state.children.get(key) ?? [];
}

// Regenerating sends the user turn again from the same parent, so the server holds a sibling with the
// same text; such siblings read as one turn whose replies are the branches.
function sameTurn(userId) {
  const user = state.nodes.get(userId);
  return kids(user.parent_id ?? ROOT).filter((id) => {
    const other = state.nodes.get(id);
    return other.role === "user" && other.content === user.content;
  });
}

function replyKey(userId) {
  const user = state.nodes.get(userId);
  return `replies:${user.parent_id ?? ROOT}:${user.content}`;
}

function selectPathTo(id) {
  while (id) {
    const node = state.nodes.get(id);
    if (!node) return;
    const parent = node.parent_id ?? ROOT;
    if (node.role === "assistant" && parent !== ROOT && state.nodes.get(parent)?.role === "user") {
      state.choice.set(replyKey(parent), id);
    }
    state.choice.set(parent, id);
    id = node.parent_id;
  }
}

// The messages shown: from the root, the chosen child at each step. Each entry has the alternatives
// the arrows move between.
function shownPath() {
  const path = [];
  let key = ROOT;
  for (;;) {
    const children = kids(key);
    if (!children.length) return path;
    const chosen = state.choice.get(key);
    const id = children.includes(chosen) ? chosen : children[children.length - 1];
    const node = state.nodes.get(id);
    if (node.role !== "user") {
      path.push({ node, alternatives: children, choiceKey: key });
      key = id;
      continue;
    }
    const distinctTexts = distinctUserTurns(children);
    path.push({ node, alternatives: distinctTexts, choiceKey: key, selected: distinctTexts.find((d) => state.nodes.get(d).content === node.content) });
    const replies = sameTurn(id).flatMap((turn) => kids(turn));
    if (!replies.length) return path;
    const rKey = replyKey(id);
    const reply = replies.includes(state.choice.get(rKey)) ? state.choice.get(rKey) : replies[replies.length - 1];
    path.push({ node: state.nodes.get(reply), alternatives: replies, choiceKey: rKey });
    key = reply;
  }
}

function distinctUserTurns(children) {
  const seen = new Map();
  for (const id of children) {
    const node = state.nodes.get(id);
    if (node.role === "user") seen.set(node.content, id); // the newest of each text
    else seen.set(`\u0000${id}`, id);
  }
  return [...seen.values()];
}

// ---- rendering ------------------------------------------------------------------------------------

function render() {
  const list = $("#messages");
  list.replaceChildren();
  const path = shownPath();
  for (const entry of path) list.append(messageView(entry));
  if (state.pending) {
    if (state.pending.user) list.append(messageView({ node: state.pending.user, alternatives: [] }));
    list.append(messageView({ node: state.pending.reply, alternatives: [] }));
  }
  const system = path.find((entry) => entry.node.role === "system");
  $("#system-prompt").disabled = path.length > 0;
  if (system) $("#system-prompt").value = system.node.content;
  $("#empty").hidden = path.length > 0 || state.pending !== null;
  renderConversations();
  list.scrollTop = list.scrollHeight;
}

// A conversation an API client kept holds its tools' calls and outputs, and reasoning, too (each a message of
// its own).
function roleLabel(node) {
  if (node.tool_call) return "Tool call";
  if (node.reasoning) return "Reasoning";
  const labels = { assistant: "Assistant", user: "You", tool: "Tool output" };
  return labels[node.role] ?? "System";
}

function callView(call) {
  const code = document.createElement("code");
  code.className = "tool-call";
  code.textContent = `${call.name}(${call.arguments})`;
  return code;
}

function messageView({ node, alternatives, choiceKey, selected }) {
  const view = document.createElement("article");
  view.className = `msg ${node.role}`;
  view.dataset.id = node.id;
  const head = document.createElement("header");
  const role = document.createElement("span");
  role.className = "role";
  role.textContent = roleLabel(node);
  head.append(role);
  if (alternatives.length > 1) head.append(branchArrows(alternatives, selected ?? node.id, choiceKey));
  const body = document.createElement("div");
  body.className = "body";
  if (node.tool_call) body.append(callView(node.tool_call));
  else if (isAnswer(node)) body.append(...answerView(node));
  else body.textContent = node.content;
  const images = imagesOf(node);
  if (images.length) {
    const strip = document.createElement("div");
    strip.className = "images";
    strip.append(...images.map(thumbnail));
    body.prepend(strip);
  }
  view.append(head, body);
  if (node.streaming) view.classList.add("streaming");
  if (node.error) view.append(notice(node.error));
  view.append(actions(node));
  return view;
}

function branchArrows(alternatives, current, choiceKey) {
  const nav = document.createElement("span");
  nav.className = "branches";
  const index = Math.max(0, alternatives.indexOf(current));
  const move = (step) => {
    const target = alternatives[(index + step + alternatives.length) % alternatives.length];
    state.choice.set(choiceKey, target);
    render();
  };
  const back = button("‹", "Previous branch", () => move(-1), "prev");
  const label = document.createElement("span");
  label.className = "branch-label";
  label.textContent = `${index + 1}/${alternatives.length}`;
  const next = button("›", "Next branch", () => move(1), "next");
  back.disabled = state.pending !== null;
  next.disabled = state.pending !== null;
  nav.append(back, label, next);
  return nav;
}

function actions(node) {
  const bar = document.createElement("footer");
  if (node.role === "system") return bar;
  bar.append(copyButton(() => node.content));
  const idle = state.pending === null && !node.pending && !node.unstored;
  // A branch needs a parent to start from: the server appends a turn without one after the head.
  const branchable = (user) => user?.role === "user" && (user.parent_id !== null || state.current?.local);
  if (node.role === "assistant") {
    const stats = state.stats.get(node.id);
    const tokens = stats?.tokens ?? node.token_count;
    const meta = document.createElement("span");
    meta.className = "meta";
    const parts = [];
    if (stats?.answeredBy && stats.answeredBy !== stats.asked) parts.push(`answered by ${stats.answeredBy}`);
    if (tokens != null) parts.push(`${tokens} tokens`);
    if (stats?.firstTokenMs != null) parts.push(`first token ${(stats.firstTokenMs / 1000).toFixed(2)} s`);
    if (stats?.totalMs != null) parts.push(`${(stats.totalMs / 1000).toFixed(2)} s`);
    if (stats?.stopped) parts.push("stopped");
    meta.textContent = parts.join(" · ");
    if (idle && branchable(state.nodes.get(node.parent_id))) bar.append(button("Regenerate", "Regenerate this answer", () => regenerate(node), "regenerate"));
    bar.append(meta);
  } else if (idle && branchable(node)) {
    bar.append(button("Edit", "Edit this message (a new branch)", () => edit(node), "edit"));
  }
  return bar;
}

function button(text, title, onClick, className = "") {
  const element = document.createElement("button");
  element.type = "button";
  element.textContent = text;
  element.title = title;
  element.className = className;
  element.addEventListener("click", onClick);
  return element;
}

function notice(text) {
  const element = document.createElement("div");
  element.className = "notice";
  element.textContent = text;
  return element;
}

function showError(error) {
  const bar = $("#error");
  bar.textContent = error ? (error instanceof Error ? error.message : String(error)) : "";
  bar.hidden = !error;
}

function renderConversations() {
  const list = $("#conversations");
  list.replaceChildren();
  for (const conversation of state.conversations) {
    const item = document.createElement("li");
    item.className = conversation.id === state.current?.id ? "active" : "";
    item.dataset.id = conversation.id;
    const open = button(conversation.title || "New chat", "Open", () => openConversation(conversation.id), "open");
    const rename = button("✎", "Rename", () => renameConversation(conversation, item), "rename");
    const remove = button("×", "Delete", () => deleteConversation(conversation.id), "delete");
    item.append(open, rename, remove);
    list.append(item);
  }
  $("#store-note").hidden = state.stored;
}

// ---- conversations --------------------------------------------------------------------------------

async function loadConversations() {
  try {
    const page = await call("GET", "/v1/conversations?limit=100");
    state.stored = true;
    state.conversations = page.data;
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) state.stored = false; // no store (or a gateway)
    else showError(error);
    state.conversations = [];
  }
  renderConversations();
}

async function openConversation(id) {
  if (state.pending) return;
  showError(null);
  try {
    const tree = await call("GET", `/v1/conversations/${encodeURIComponent(id)}/tree`);
    state.current = state.conversations.find((c) => c.id === id) ?? { id };
    loadTree(tree.data, tree.head_message_id);
    if (state.current.model) selectModel(state.current.model);
    history.replaceState(null, "", `#${id}`);
  } catch (error) {
    showError(error);
  }
  render();
}

function newConversation() {
  if (state.pending) return;
  state.current = null;
  loadTree([], null);
  $("#system-prompt").value = DEFAULT_SYSTEM_PROMPT;
  history.replaceState(null, "", location.pathname);
  showError(null);
  render();
  $("#prompt").focus();
}

function renameConversation(conversation, item) {
  const input = document.createElement("input");
  input.value = conversation.title ?? "";
  input.className = "rename-input";
  input.setAttribute("aria-label", "New title");
  item.replaceChildren(input);
  input.focus();
  input.addEventListener("keydown", async (event) => {
    if (event.key === "Escape") renderConversations();
    if (event.key !== "Enter") return;
    try {
      const updated = await call("POST", `/v1/conversations/${encodeURIComponent(conversation.id)}`, { title: input.value });
      conversation.title = updated.title;
    } catch (error) {
      showError(error);
    }
    renderConversations();
  });
}

async function deleteConversation(id) {
  try {
    await call("DELETE", `/v1/conversations/${encodeURIComponent(id)}`);
  } catch (error) {
    showError(error);
    return;
  }
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.current?.id === id) newConversation();
  else renderConversations();
}

// A conversation for the first message: on the server (with the system prompt as its first message,
// so that every turn has a parent to branch from), or in this tab.
async function ensureConversation(firstText) {
  if (state.current) return;
  const model = $("#model").value;
  const system = $("#system-prompt").value.trim() || DEFAULT_SYSTEM_PROMPT;
  if (!state.stored) {
    state.current = { id: `local-${Date.now()}`, title: firstText.slice(0, 60), model, local: true };
    loadTree([{ id: "local-system", parent_id: null, role: "system", content: system }], "local-system");
    return;
  }
  const created = await call("POST", "/v1/conversations", { model, messages: [{ role: "system", content: system }] });
  state.current = created;
  state.conversations.unshift(created);
  const tree = await call("GET", `/v1/conversations/${encodeURIComponent(created.id)}/tree`);
  loadTree(tree.data, tree.head_message_id);
  history.replaceState(null, "", `#${created.id}`);
}

// ---- asking ---------------------------------------------------------------------------------------

// What a new message follows: the last message shown that the server has (a stopped turn was not stored).
function lastShown() {
  const stored = shownPath().filter((entry) => !entry.node.unstored);
  return stored.length ? stored[stored.length - 1].node : null;
}

function historyTo(node) {
  const turns = [];
  for (let id = node?.id; id; id = state.nodes.get(id).parent_id) {
    const message = state.nodes.get(id);
    turns.unshift({ role: message.role, content: content(message.content, imagesOf(message)) });
  }
  return turns;
}

async function send() {
  const text = $("#prompt").value;
  const images = state.attachments;
  if ((!text.trim() && !images.length) || state.pending) return;
  showError(null);
  try {
    await ensureConversation(text);
  } catch (error) {
    showError(error);
    return;
  }
  $("#prompt").value = "";
  state.attachments = [];
  renderAttachments();
  await ask(text, lastShown(), images);
}

async function regenerate(reply) {
  const user = state.nodes.get(reply.parent_id);
  await ask(user.content, state.nodes.get(user.parent_id) ?? null, imagesOf(user));
}

function edit(user) {
  const view = document.querySelector(`.msg[data-id="${CSS.escape(user.id)}"]`);
  const box = document.createElement("textarea");
  box.className = "edit-box";
  box.value = user.content;
  const save = button("Send", "Send the edited message as a new branch",
    () => ask(box.value, state.nodes.get(user.parent_id) ?? null, imagesOf(user)), "save-edit");
  const cancel = button("Cancel", "Keep the message", render, "cancel-edit");
  view.querySelector(".body").replaceChildren(box);
  view.querySelector("footer").replaceChildren(save, cancel);
  box.focus();
}

// Streams the answer to `text` (and `images`) sent after `parent` (null: the start), then shows the stored turn.
async function ask(text, parent, images = []) {
  if ((!text.trim() && !images.length) || state.pending) return;
  const model = $("#model").value;
  const local = state.current.local;
  const user = { id: `pending-user-${Date.now()}`, parent_id: parent?.id ?? null, role: "user", content: text, images,
    pending: true };
  const reply = { id: `pending-reply-${Date.now()}`, parent_id: user.id, role: "assistant", content: "", streaming: true, pending: true };
  const controller = new AbortController();
  state.pending = { user, reply, streamId: null, controller };
  const stats = { tokens: null, firstTokenMs: null, totalMs: null, asked: model, answeredBy: null };
  const started = performance.now();
  const body = { model, messages: [{ role: "user", content: content(text, images) }], ...settings() };
  if (local) body.messages = [...historyTo(parent), { role: "user", content: content(text, images) }];
  else {
    body.conversation_id = state.current.id;
    if (parent) body.parent_message_id = parent.id;
  }
  setBusy(true);
  render();
  let stopped = false;
  try {
    await streamChat(body, {
      signal: controller.signal,
      onStart: (streamId) => { state.pending.streamId = streamId; },
      onChunk: (chunk) => {
        stats.answeredBy ??= chunk.model ?? null; // a router's pick (model "auto") names the model that ran
        const delta = chunk.choices?.[0]?.delta ?? {};
        if (delta.content || delta.reasoning_content) {
          if (stats.firstTokenMs === null) stats.firstTokenMs = performance.now() - started;
          reply.content += delta.content ?? "";
          if (delta.reasoning_content) reply.thought = (reply.thought ?? "") + delta.reasoning_content;
          updateReply(reply);
        }
        if (chunk.usage) stats.tokens = chunk.usage.completion_tokens;
      },
      onReconnecting: () => setConnection("Connection lost: reconnecting…"),
      onResumed: () => setConnection(""),
    });
  } catch (error) {
    if (controller.signal.aborted) stopped = true;
    else reply.error = error.message;
    if (error instanceof ApiError && error.status !== 0) showError(error);
  }
  stats.totalMs = performance.now() - started;
  stats.stopped = stopped;
  setConnection("");
  reply.streaming = false;
  state.pending = null;
  setBusy(false);
  if (stopped || reply.error) showUnstored(user, reply, stats); // not stored: on screen until the next turn
  else await storeTurn(user, reply, stats, local);
  // How many answers ended in this tab (done, stopped or failed): lets a script wait for the next one.
  document.body.dataset.answers = String(Number(document.body.dataset.answers ?? 0) + 1);
}

function showUnstored(user, reply, stats) {
  user.unstored = reply.unstored = true;
  addNode(user);
  addNode(reply);
  state.stats.set(reply.id, stats);
  selectPathTo(reply.id);
  render();
}

let localIds = 0;

async function storeTurn(user, reply, stats, local) {
  if (local) {
    user.id = `local-${++localIds}`; // (crypto.randomUUID needs a secure context: not plain http)
    reply.id = `local-${++localIds}`;
    reply.parent_id = user.id;
    user.pending = reply.pending = false;
    addNode(user);
    addNode(reply);
    state.stats.set(reply.id, stats);
    selectPathTo(reply.id);
    render();
    return;
  }
  try {
    const tree = await call("GET", `/v1/conversations/${encodeURIComponent(state.current.id)}/tree`);
    const choices = new Map(state.choice);
    loadTree(tree.data, tree.head_message_id);
    for (const [key, value] of choices) if (!state.choice.has(key)) state.choice.set(key, value);
    state.stats.set(tree.head_message_id, stats);
    const summary = state.conversations.find((c) => c.id === state.current.id);
    if (summary && !summary.title) summary.title = user.content.slice(0, 60);
  } catch (error) {
    showError(error);
  }
  render();
}

// An answer as markdown, after its reasoning (if any) folded away as plain text (`open`: unfolded).
function answerView(node, open = false) {
  if (!node.thought) return [renderMarkdown(node.content)];
  const thought = document.createElement("details");
  thought.className = "thought";
  thought.open = open;
  const summary = document.createElement("summary");
  summary.textContent = node.streaming && !node.content ? "Thinking…" : "Reasoning";
  const text = document.createElement("div");
  text.className = "thought-text";
  text.textContent = node.thought;
  thought.append(summary, text);
  return [thought, renderMarkdown(node.content)];
}

// The streaming answer is drawn at most once a frame, however fast its chunks come.
let drawScheduled = false;

function updateReply(reply) {
  if (drawScheduled) return;
  drawScheduled = true;
  requestAnimationFrame(() => {
    drawScheduled = false;
    const view = document.querySelector(`.msg[data-id="${CSS.escape(reply.id)}"] .body`);
    if (!view) return;
    view.replaceChildren(...answerView(reply, view.querySelector(".thought")?.open));
    $("#messages").scrollTop = $("#messages").scrollHeight;
  });
}

async function stop() {
  const pending = state.pending;
  if (!pending) return;
  pending.controller.abort();
  if (pending.streamId) await cancelStream(pending.streamId);
}

function settings() {
  const chosen = {};
  const temperature = $("#temperature").value;
  const maxTokens = $("#max-tokens").value;
  const seed = $("#seed").value;
  if (temperature !== "") chosen.temperature = Number(temperature);
  if (maxTokens !== "") chosen.max_tokens = Number(maxTokens);
  if (seed !== "") chosen.seed = Number(seed);
  return chosen;
}

function setBusy(busy) {
  $("#send").hidden = busy;
  $("#stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

function setConnection(text) {
  const status = $("#connection");
  status.textContent = text;
  status.hidden = !text;
}

// ---- models, key, theme, keyboard -----------------------------------------------------------------

async function loadModels() {
  try {
    const models = await call("GET", "/v1/models");
    const select = $("#model");
    select.replaceChildren(...models.data.map((model) => {
      const option = document.createElement("option");
      option.value = option.textContent = model.id;
      return option;
    }));
    return true;
  } catch (error) {
    showError(error);
    return false;
  }
}

function selectModel(name) {
  const select = $("#model");
  if ([...select.options].some((option) => option.value === name)) select.value = name;
}

function setTheme(theme) {
  document.documentElement.dataset.theme = theme;
  localStorage.setItem("llmserve.theme", theme);
  $("#theme").textContent = theme === "dark" ? "Light theme" : "Dark theme";
}

async function connect() {
  showError(null);
  if (await loadModels()) {
    await loadConversations();
    const wanted = location.hash.slice(1);
    if (wanted && state.conversations.some((c) => c.id === wanted)) await openConversation(wanted);
  }
  render();
}

function init() {
  const storedTheme = localStorage.getItem("llmserve.theme");
  setTheme(storedTheme ?? (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light"));
  $("#theme").addEventListener("click", () => setTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark"));
  $("#api-key").value = apiKey();
  $("#api-key").addEventListener("change", (event) => { setApiKey(event.target.value.trim()); connect(); });
  $("#new-chat").addEventListener("click", newConversation);
  $("#send").addEventListener("click", send);
  $("#attach").addEventListener("click", () => $("#image-file").click());
  $("#image-file").addEventListener("change", (event) => attach([...event.target.files]).catch(showError));
  $("#stop").addEventListener("click", stop);
  $("#menu").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  $("#system-prompt").value = DEFAULT_SYSTEM_PROMPT;
  $("#prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.pending) {
      event.preventDefault();
      stop();
    }
  });
  connect();
}

init();
