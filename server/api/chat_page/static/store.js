// What the page keeps in this browser's localStorage: the conversations, which one is open, the settings.
// Nothing of it goes to the server except as the messages of a request.

const KEYS = {
  conversations: "emberserve.chat.conversations",
  current: "emberserve.chat.current",
  settings: "emberserve.chat.settings",
};
export const DEFAULT_SETTINGS = {
  model: "", preset: "", system: "", temperature: "", top_p: "", max_tokens: 1024, theme: "auto",
};
const TITLE_LENGTH = 48;

function read(key, fallback) {
  try {
    const text = localStorage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback; // unreadable (another program's value, or storage disabled): start afresh
  }
}

function write(key, value) {
  localStorage.setItem(key, JSON.stringify(value)); // throws when the storage is full or disabled
}

export function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

/** A title from the first user message: its first line, shortened. */
export function titleFrom(text) {
  const line = text.trim().split("\n")[0].trim();
  return line.length > TITLE_LENGTH ? `${line.slice(0, TITLE_LENGTH - 1)}…` : line || "New chat";
}

export class Store {
  /** `onSaveError(error)`: a write failed (the storage is full or disabled); the page goes on without saving. */
  constructor(onSaveError) {
    this.onSaveError = onSaveError;
    const list = read(KEYS.conversations, []);
    this.conversations = Array.isArray(list) ? list.filter((c) => c && Array.isArray(c.messages)) : [];
    this.currentId = read(KEYS.current, null);
    this.settings = { ...DEFAULT_SETTINGS, ...read(KEYS.settings, {}) };
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) ?? null;
  }

  /** A new empty conversation, first in the list and open; its system prompt is the last one used. */
  create() {
    const now = Date.now();
    const conversation = {
      id: newId(), title: "New chat", titled: false, created: now, updated: now,
      system: this.settings.system, messages: [],
    };
    this.conversations.unshift(conversation);
    this.currentId = conversation.id;
    this.save();
    return conversation;
  }

  open(id) {
    this.currentId = id;
    this.save();
  }

  rename(conversation, title) {
    conversation.title = title.trim() || conversation.title;
    conversation.titled = true;
    this.touch(conversation);
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = this.conversations[0]?.id ?? null;
    this.save();
  }

  /** The conversation changed: it moves to the top of the list, and everything is saved. */
  touch(conversation) {
    conversation.updated = Date.now();
    this.conversations = [conversation, ...this.conversations.filter((c) => c !== conversation)];
    this.save();
  }

  save() {
    try {
      write(KEYS.conversations, this.conversations);
      write(KEYS.current, this.currentId);
    } catch (error) {
      this.onSaveError(error);
    }
  }

  saveSettings() {
    try {
      write(KEYS.settings, this.settings);
    } catch (error) {
      this.onSaveError(error);
    }
  }
}

/** The conversation as a JSON file's text (the export). */
export function exportText(conversation) {
  return JSON.stringify({ format: "emberserve-chat", version: 1, exported: new Date().toISOString(),
                          conversation }, null, 2);
}
