// The chat page: conversations, the composer, streaming answers, settings. Talks to the server through api.js,
// keeps everything in the browser through store.js, renders model output through markdown.js only.

import { ApiError, askKey, getJson, streamChat } from "./api.js";
import { icon, placeIcons } from "./icons.js";
import { renderMarkdown } from "./markdown.js";
import { Store, exportText, titleFrom } from "./store.js";

const $ = (id) => document.getElementById(id);
const store = new Store((error) => showBanner(`Cannot save in this browser's storage: ${error.message}`));
const THEMES = ["auto", "light", "dark"];
const THEME_NAMES = { auto: "automatic", light: "light", dark: "dark" };
const SAVE_EVERY_MS = 1000; // how often a streaming answer is saved (a reload mid-answer keeps most of it)
const WIDE = window.matchMedia("(min-width: 900px)");

let presets = []; // GET /v1/presets
let serverPreset = null; // the server's --preset, applied when a request names none
let running = null; // {controller, conversation, message, element} while an answer streams

// ---- small helpers ---------------------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== false && value !== null && value !== undefined) {
      node.setAttribute(name, value === true ? "" : value);
    }
  }
  node.append(...children);
  return node;
}

function announce(text) {
  $("status").textContent = text;
}

function showBanner(text) {
  const banner = $("banner");
  banner.hidden = !text;
  banner.textContent = text ?? "";
}

// ---- theme -------------------------------------------------------------------------------------------------------

function applyTheme() {
  const theme = store.settings.theme;
  if (theme === "auto") document.documentElement.removeAttribute("data-theme");
  else document.documentElement.dataset.theme = theme;
  const next = THEMES[(THEMES.indexOf(theme) + 1) % THEMES.length];
  $("toggle-theme").setAttribute("aria-label", `Theme: ${THEME_NAMES[theme]} (switch to ${THEME_NAMES[next]})`);
  $("toggle-theme").title = `Theme: ${THEME_NAMES[theme]}`;
}

// ---- panels (side bars on wide screens, overlays on phones) ------------------------------------------------------

function setPanel(name, open) {
  document.body.classList.toggle(`${name}-open`, open);
  $(`toggle-${name}`).setAttribute("aria-expanded", String(open));
}

function closeOverlays() {
  if (!WIDE.matches) {
    setPanel("sidebar", false);
    setPanel("settings", false);
  }
}

// ---- settings ----------------------------------------------------------------------------------------------------

function presetByName(name) {
  return presets.find((p) => p.name === name) ?? null;
}

function showPresetDefaults() {
  const preset = presetByName(store.settings.preset || serverPreset);
  $("temperature").placeholder = preset ? `${preset.temperature} (preset)` : "model default";
  $("top-p").placeholder = preset ? `${preset.top_p} (preset)` : "model default";
  $("preset-description").textContent = preset ? preset.description : "";
}

function fillPresets() {
  const select = $("preset");
  select.replaceChildren(el("option", { value: "" }, serverPreset ? `server default (${serverPreset})` : "none"),
    ...presets.map((p) => el("option", { value: p.name }, p.name)));
  select.value = presetByName(store.settings.preset) ? store.settings.preset : "";
  showPresetDefaults();
}

function bindSettings() {
  const s = store.settings;
  $("temperature").value = s.temperature;
  $("top-p").value = s.top_p;
  $("max-tokens").value = s.max_tokens;
  $("preset").addEventListener("change", () => {
    s.preset = $("preset").value;
    const preset = presetByName(s.preset);
    if (preset) {
      s.max_tokens = preset.max_tokens; // the preset's budget, until the user sets another
      $("max-tokens").value = s.max_tokens;
    }
    showPresetDefaults();
    store.saveSettings();
  });
  for (const [id, field] of [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"]]) {
    $(id).addEventListener("input", () => {
      s[field] = $(id).value.trim();
      store.saveSettings();
    });
  }
  $("system").addEventListener("input", () => {
    s.system = $("system").value;
    const conversation = store.current;
    if (conversation) {
      conversation.system = s.system;
      store.save();
    }
    store.saveSettings();
  });
  $("model").addEventListener("change", () => {
    s.model = $("model").value;
    store.saveSettings();
  });
}

/** The request's fields besides the messages: model, preset, sampling values the user set, the token budget. */
function requestFields() {
  const s = store.settings;
  const body = { model: $("model").value || s.model };
  if (s.preset) body.preset = s.preset;
  for (const field of ["temperature", "top_p"]) {
    const value = Number.parseFloat(s[field]);
    if (String(s[field]).trim() !== "" && Number.isFinite(value)) body[field] = value;
  }
  const budget = Number.parseInt(s.max_tokens, 10);
  body.max_tokens = Number.isFinite(budget) ? budget : 1024;
  return body;
}

async function loadModels() {
  try {
    const models = (await getJson("/v1/models")).data.map((m) => m.id);
    $("model").replaceChildren(...models.map((id) => el("option", { value: id }, id)));
    $("model").value = models.includes(store.settings.model) ? store.settings.model : models[0] ?? "";
    showBanner(null);
  } catch (error) {
    showBanner(`Cannot list the models: ${error.message}`);
    if (error instanceof ApiError && error.status === 503) setTimeout(loadModels, 3000); // still loading
  }
}

async function loadPresets() {
  try {
    const answer = await getJson("/v1/presets");
    presets = answer.data;
    serverPreset = answer.default ?? null;
  } catch {
    presets = []; // a server without presets: the picker offers none
  }
  fillPresets();
}

// ---- the conversation list ---------------------------------------------------------------------------------------

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const link = el("a", { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function exportConversation(conversation) {
  const slug = conversation.title.toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "") || "chat";
  download(`emberserve-${slug}.json`, exportText(conversation));
}

function startRename(item, conversation) {
  const input = el("input", { class: "rename", value: conversation.title, "aria-label": "Conversation name" });
  const finish = (keep) => {
    if (keep) store.rename(conversation, input.value);
    renderAll();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") {
      event.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true), { once: true });
  item.replaceChildren(input);
  input.focus();
  input.select();
}

function renderList() {
  const items = store.conversations.map((c) => {
    const current = c.id === store.currentId;
    const item = el("li", { class: current ? "current" : "" });
    item.append(
      el("button", { type: "button", class: "open", "aria-current": current ? "true" : false,
                     onclick: () => openConversation(c.id) }, c.title),
      el("span", { class: "item-actions" },
        el("button", { type: "button", class: "icon small", "aria-label": `Rename ${c.title}`, title: "Rename",
                       onclick: () => startRename(item, c) }, icon("rename")),
        el("button", { type: "button", class: "icon small", "aria-label": `Export ${c.title}`, title: "Export (JSON)",
                       onclick: () => exportConversation(c) }, icon("export")),
        el("button", { type: "button", class: "icon small", "aria-label": `Delete ${c.title}`, title: "Delete",
                       onclick: () => deleteConversation(c) }, icon("delete"))),
    );
    return item;
  });
  $("conversations").replaceChildren(...items);
}

function openConversation(id) {
  stop();
  store.open(id);
  renderAll();
  closeOverlays();
  $("prompt").focus();
}

function newConversation() {
  stop();
  const current = store.current;
  if (current && current.messages.length === 0) {
    current.system = store.settings.system; // reuse the empty one
  } else {
    store.create();
  }
  store.save();
  renderAll();
  closeOverlays();
  $("prompt").focus();
}

function deleteConversation(conversation) {
  if (!window.confirm(`Delete "${conversation.title}"?`)) return;
  if (running?.conversation === conversation) stop();
  store.remove(conversation.id);
  renderAll();
}

// ---- messages ----------------------------------------------------------------------------------------------------

function formatStats(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.tokensPerSecond) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.ttftMs !== undefined) parts.push(`first token ${Math.round(stats.ttftMs)} ms`);
  if (stats.promptTokens !== undefined) {
    parts.push(`${stats.promptTokens} prompt + ${stats.completionTokens} completion tokens`);
  }
  if (stats.stopped) parts.push("stopped");
  if (stats.finishReason === "length") parts.push("cut at max tokens");
  return parts.join(" · ");
}

function fillThinking(element, message) {
  // A reasoning model's thinking: plain text (never markup), folded away under the answer's label.
  const thinking = element.querySelector(".thinking");
  thinking.hidden = !message.reasoning;
  thinking.querySelector(".thinking-text").textContent = message.reasoning ?? "";
}

function fillAssistant(element, message) {
  fillThinking(element, message);
  element.querySelector(".content").innerHTML = renderMarkdown(message.content);
  element.querySelector(".message-error").textContent = message.error ? `Error: ${message.error}` : "";
  element.querySelector(".message-error").hidden = !message.error;
  element.querySelector(".stats").textContent = formatStats(message.stats);
}

function startEdit(element, index) {
  const conversation = store.current;
  const box = el("textarea", { class: "edit", rows: 3, "aria-label": "Edit message" });
  box.value = conversation.messages[index].content;
  const resend = () => {
    const text = box.value.trim();
    if (text) editAndResend(index, text);
  };
  box.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      resend();
    } else if (event.key === "Escape") {
      event.stopPropagation();
      renderMessages();
    }
  });
  element.querySelector(".content").replaceWith(box);
  element.querySelector(".meta").replaceChildren(
    el("button", { type: "button", class: "primary small", onclick: resend }, "Send"),
    el("button", { type: "button", class: "small", onclick: () => renderMessages() }, "Cancel"));
  box.focus();
}

function messageElement(message, index, last) {
  if (message.role === "user") {
    const element = el("article", { class: "message user", "aria-label": "You" },
      el("div", { class: "role", "aria-hidden": "true" }, "You"),
      el("div", { class: "content plain" }, message.content));
    element.append(el("footer", { class: "meta" },
      el("button", { type: "button", class: "small", "aria-label": "Edit this message and resend",
                     disabled: Boolean(running), onclick: () => startEdit(element, index) }, "Edit")));
    return element;
  }
  const element = el("article", { class: "message assistant", "aria-label": "Assistant" },
    el("div", { class: "role", "aria-hidden": "true" }, "Assistant"),
    el("details", { class: "thinking", hidden: true },
      el("summary", {}, "Thinking"), el("div", { class: "thinking-text plain" })),
    el("div", { class: "content markdown" }),
    el("p", { class: "message-error", role: "alert" }),
    el("footer", { class: "meta" }, el("span", { class: "stats" })));
  if (last) {
    element.querySelector(".meta").append(
      el("button", { type: "button", class: "small regenerate", "aria-label": "Regenerate this answer",
                     disabled: Boolean(running), onclick: regenerate }, "Regenerate"));
  }
  fillAssistant(element, message);
  return element;
}

function renderMessages() {
  const conversation = store.current;
  const messages = conversation?.messages ?? [];
  const elements = messages.map((m, i) => messageElement(m, i, i === messages.length - 1));
  $("messages").replaceChildren(...elements);
  $("empty").hidden = messages.length > 0;
  if (running && running.conversation === conversation) {
    running.element = elements[elements.length - 1];
    running.element.setAttribute("aria-busy", "true");
  }
  $("conversation-title").textContent = conversation?.title ?? "emberserve";
  $("system").value = conversation?.system ?? store.settings.system;
  scrollToEnd(true);
}

function renderAll() {
  renderList();
  renderMessages();
}

function nearEnd(box) {
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function scrollToEnd(force) {
  const box = $("messages");
  if (force || nearEnd(box)) box.scrollTop = box.scrollHeight;
}

// ---- answering ---------------------------------------------------------------------------------------------------

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  for (const button of document.querySelectorAll(".message .meta button")) button.disabled = on;
}

/** Streams a new answer to the conversation's messages, showing it as it arrives. */
async function answer(conversation) {
  const history = conversation.messages.filter((m) => m.role === "user" || m.content);
  const messages = [
    ...(conversation.system.trim() ? [{ role: "system", content: conversation.system }] : []),
    ...history.map(({ role, content }) => ({ role, content })),
  ];
  const message = { role: "assistant", content: "" };
  conversation.messages.push(message);
  store.touch(conversation);
  running = { controller: new AbortController(), conversation, message, element: null };
  renderAll();
  setRunning(true);
  announce("Answering…");

  const started = performance.now();
  let first = null;
  let frame = 0;
  let saved = started;
  const show = () => {
    frame = 0;
    if (running?.message === message && running.element) {
      const stick = nearEnd($("messages"));
      fillThinking(running.element, message);
      running.element.querySelector(".content").innerHTML = renderMarkdown(message.content);
      if (stick) scrollToEnd(true);
    }
  };
  try {
    const { usage, finishReason } = await streamChat({ ...requestFields(), messages }, running.controller.signal,
      (delta) => {
        first ??= performance.now();
        message.content += delta;
        if (!frame) frame = requestAnimationFrame(show);
        if (performance.now() - saved > SAVE_EVERY_MS) {
          saved = performance.now();
          store.save();
        }
      },
      (thought) => {
        first ??= performance.now();
        message.reasoning = (message.reasoning ?? "") + thought;
        if (!frame) frame = requestAnimationFrame(show);
      });
    const end = performance.now();
    message.stats = { finishReason, ttftMs: first === null ? undefined : first - started };
    if (usage) {
      message.stats.promptTokens = usage.prompt_tokens;
      message.stats.completionTokens = usage.completion_tokens;
      // Decoding speed: the tokens after the first, over the time after the first.
      if (usage.completion_tokens > 1 && end > first) {
        message.stats.tokensPerSecond = (usage.completion_tokens - 1) / ((end - first) / 1000);
      }
    }
    announce("Answer complete.");
  } catch (error) {
    if (error.name === "AbortError") {
      message.stats = { stopped: true, ttftMs: first === null ? undefined : first - started };
      announce("Stopped.");
    } else {
      message.error = error.message;
      announce(`Error: ${error.message}`);
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    running = null;
    setRunning(false);
    store.touch(conversation);
    if (store.current === conversation) renderAll();
    // The button that asked (Regenerate, an edit's Send) is gone with the re-render: back to the message box, on a
    // wide screen (on a phone, focusing it would open the keyboard over the answer).
    if (WIDE.matches && document.activeElement === document.body) $("prompt").focus();
  }
}

async function send(text) {
  if (running || !text.trim()) return;
  const conversation = store.current ?? store.create();
  conversation.messages.push({ role: "user", content: text });
  if (!conversation.titled && conversation.messages.length === 1) conversation.title = titleFrom(text);
  $("prompt").value = "";
  await answer(conversation);
}

function regenerate() {
  const conversation = store.current;
  if (running || !conversation || conversation.messages.at(-1)?.role !== "assistant") return;
  conversation.messages.pop();
  answer(conversation);
}

function editAndResend(index, text) {
  const conversation = store.current;
  if (running || !conversation) return;
  conversation.messages = [...conversation.messages.slice(0, index), { role: "user", content: text }];
  if (index === 0 && !conversation.titled) conversation.title = titleFrom(text);
  answer(conversation);
}

/** Stops the streaming answer: the request is aborted, so the server sees the client leave and frees its work. */
function stop() {
  running?.controller.abort();
}

// ---- start -------------------------------------------------------------------------------------------------------

function bindKeys() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send($("prompt").value);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send($("prompt").value);
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && running) {
      event.preventDefault();
      stop();
    } else if (event.key === "Escape") {
      closeOverlays();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newConversation);
  $("toggle-sidebar").addEventListener("click", () => {
    setPanel("sidebar", !document.body.classList.contains("sidebar-open"));
    if (!WIDE.matches) setPanel("settings", false);
  });
  $("toggle-settings").addEventListener("click", () => {
    setPanel("settings", !document.body.classList.contains("settings-open"));
    if (!WIDE.matches) setPanel("sidebar", false);
  });
  $("toggle-theme").addEventListener("click", () => {
    const s = store.settings;
    s.theme = THEMES[(THEMES.indexOf(s.theme) + 1) % THEMES.length];
    applyTheme();
    store.saveSettings();
  });
  $("change-key").addEventListener("click", async () => {
    if (await askKey("")) {
      await Promise.all([loadModels(), loadPresets()]);
    }
  });
}

function showPanelsForWidth() {
  setPanel("sidebar", WIDE.matches);
  setPanel("settings", WIDE.matches);
}

function start() {
  placeIcons();
  applyTheme();
  showPanelsForWidth();
  WIDE.addEventListener("change", showPanelsForWidth);
  if (!store.current) store.currentId = store.conversations[0]?.id ?? null;
  if (!store.current) store.create();
  bindSettings();
  bindKeys();
  renderAll();
  $("prompt").focus();
  // With a key required and none stored, both calls' 401s share one question for it.
  Promise.all([loadPresets(), loadModels()]).then(() => document.body.classList.add("ready"));
}

start();
