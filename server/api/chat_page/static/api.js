// The server's API as the page calls it: the API key (asked for on a 401, kept in localStorage), error envelopes,
// and the event stream of a streaming chat completion.

const KEY_STORAGE = "emberserve.chat.apiKey";

/** An API failure: the envelope's error.message (or what went wrong on the way), and the HTTP status. */
export class ApiError extends Error {
  constructor(message, status = 0) {
    super(message);
    this.status = status;
  }
}

/** The error envelope's message of a failed response (`{"error": {"message": ...}}`), else its status. */
export async function errorMessage(response) {
  const text = await response.text().catch(() => "");
  try {
    const message = JSON.parse(text)?.error?.message;
    if (typeof message === "string" && message) return message;
  } catch {
    // not JSON: a proxy's page, say
  }
  return `${response.status} ${response.statusText || "error"}${text ? `: ${text.slice(0, 200)}` : ""}`;
}

export function storedKey() {
  try {
    return localStorage.getItem(KEY_STORAGE);
  } catch {
    return null;
  }
}

export function storeKey(key) {
  localStorage.setItem(KEY_STORAGE, key);
}

/**
 * Asks for the key in the page's dialog, saying why (the server's 401 message); resolves with the key, or null
 * when the user cancels. Several requests refused at once share one question.
 */
let asking = null;
export function askKey(reason) {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  document.getElementById("key-error").textContent = reason ?? "";
  input.value = "";
  asking = new Promise((resolve) => {
    const finish = (key) => {
      form.removeEventListener("submit", submit);
      dialog.removeEventListener("cancel", cancel);
      document.getElementById("key-cancel").removeEventListener("click", cancel);
      if (dialog.open) dialog.close();
      asking = null;
      resolve(key);
    };
    const submit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (key) {
        storeKey(key);
        finish(key);
      }
    };
    const cancel = (event) => {
      event.preventDefault();
      finish(null);
    };
    form.addEventListener("submit", submit);
    dialog.addEventListener("cancel", cancel);
    document.getElementById("key-cancel").addEventListener("click", cancel);
    dialog.showModal();
    input.focus();
  });
  return asking;
}

/**
 * fetch() of an API path with the stored key. A 401 asks for the key and tries again with the new one (a wrong
 * key is refused again, and asked for again, with the server's message); other failures throw ApiError.
 */
export async function apiFetch(path, init = {}) {
  for (;;) {
    const headers = new Headers(init.headers);
    const key = storedKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    let response;
    try {
      response = await fetch(path, { ...init, headers });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ApiError(`cannot reach the server: ${error.message}`);
    }
    if (response.ok) return response;
    const message = await errorMessage(response);
    if (response.status !== 401) throw new ApiError(message, response.status);
    if (init.signal?.aborted) throw new DOMException("aborted", "AbortError");
    if ((await askKey(message)) === null) throw new ApiError(message, 401);
  }
}

export async function getJson(path) {
  return (await apiFetch(path)).json();
}

/**
 * The `data:` payloads of a server-sent event stream, as they arrive (comments and other fields skipped). Lines
 * may end in \n, \r\n or \r, and a network chunk may end anywhere, even between the \r and \n of one line end.
 */
export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += value;
    const end = pending.endsWith("\r") ? pending.length - 1 : pending.length; // its \n may be in the next chunk
    const lines = pending.slice(0, end).split(/\r\n|\n|\r/);
    pending = lines.pop() + pending.slice(end);
    for (const line of lines) {
      if (line === "") {
        if (data.length) yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }
    }
  }
  if (data.length) yield data.join("\n");
}

/**
 * POST /v1/chat/completions with stream: true; calls onDelta(text) for each piece of the answer and
 * onReasoning(text) for each piece of a reasoning model's thinking, and resolves with {usage, finishReason} at the
 * end. A failure mid-stream (an `error` event) throws ApiError.
 */
export async function streamChat(body, signal, onDelta, onReasoning = () => {}) {
  const response = await apiFetch("/v1/chat/completions", {
    method: "POST", signal, headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
  });
  let usage = null;
  let finishReason = null;
  for await (const data of sseData(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(chunk.error.message ?? "the server failed mid-answer", chunk.error.code);
    if (chunk.usage) usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (choice?.delta?.reasoning) onReasoning(choice.delta.reasoning);
    if (choice?.delta?.content) onDelta(choice.delta.content);
    if (choice?.finish_reason) finishReason = choice.finish_reason;
  }
  return { usage, finishReason };
}
